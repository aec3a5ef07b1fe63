"""The coordinator's prefix index: which prefixes are cached, in which tier, and what to evict.

An entry holds the KV rows [start, length) of a prefix whose rows [0, start) belong to its parent
entry (a delta), plus the tokens and the logits of its last row. Its rows live in the shards'
host memory (RAM tier, `ram_id`) and/or in one file (disk tier, `path`). Restoring an entry
restores its chain, root first.

Eviction is least-recently-used per tier, under a byte cap, and never strands a child: an entry
leaves a tier only if it stays in another tier or has no children. The RAM tier also gives
way, by the same order, to swapped-out sequences in the shards' host memory, which it shares
with them (`evict_ram`'s `room`, `runtime.host_pool`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from layersplit.ipc.kv_file import KVFileError, read_layout

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


@dataclasses.dataclass
class Entry:
    key: str
    length: int
    start: int
    parent: str | None
    tokens: tuple[int, ...]
    logits: np.ndarray | None  # in memory; None for a disk entry not yet read
    kv_bytes: int
    ram_id: int | None = None
    path: Path | None = None
    last_used: float = dataclasses.field(default_factory=time.time)
    pins: int = 0
    saving: bool = False
    features: bool = False  # the draft's feature rows of [start, length) are kept with it
    feature_tag: str = ""  # of a file found on disk: the kind of feature rows it holds

    @property
    def in_ram(self) -> bool:
        return self.ram_id is not None


@dataclasses.dataclass
class CacheStats:
    hits_ram: int = 0
    hits_disk: int = 0
    hits_resident: int = 0  # of hits_ram: served from blocks still in the device pool, no copy
    tokens_resident: int = 0  # of tokens_restored: those
    misses: int = 0
    skipped_slow_restore: int = 0
    tokens_restored: int = 0
    restore_s: float = 0.0
    bytes_restored_disk: int = 0
    disk_read_s: float = 0.0
    bytes_written: int = 0
    save_s: float = 0.0  # from the RAM snapshot to the renamed file, summed
    save_wall_s: float = 0.0  # the time at least one save was in flight (saves overlap)
    save_copy_wait_s: float = 0.0  # of save_s: waiting for the snapshots' host copies, summed
    saves: int = 0
    save_errors: int = 0
    bad_files: int = 0
    evicted_ram: int = 0
    evicted_disk: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SaveJob:
    entry: Entry
    layout: Any
    tmp: Path
    fd: int
    waiting: set[int]
    sums: dict[str, str]
    failed: str | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    without_features: bool = False  # the draft's part failed: the file is cut before it
    # shard -> the names of the tensors it sends back to be written here (`streams_cache`)
    streamed_names: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    streamed: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # (offset, bytes)
    copy_wait_s: float = 0.0  # the longest any writer waited for its snapshot's host copy
    renamed: threading.Event = dataclasses.field(default_factory=threading.Event)  # set when
    # the save ended, `ok` if its file is in place: a child's file waits for its parent's
    ok: bool = False


@dataclasses.dataclass
class Restored:
    length: int = 0
    logits: np.ndarray | None = None
    tier: str = "none"
    leaf: Entry | None = None
    features: bool = True  # the draft got the feature rows of [0, length) too
    resident: bool = False  # its first rows were served from blocks still in the device pool


class BusySpans:
    """The time covered by intervals that arrive in any order (saves overlap, and one that began
    earlier may end later): `add` returns the seconds an interval adds to the union. Keeps the
    latest `KEEP` disjoint spans; an interval reaching back past them counts that time as new."""

    KEEP = 64

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # disjoint, by start

    def add(self, began: float, ended: float) -> float:
        if ended <= began:
            return 0.0
        lo, hi, kept, covered = began, ended, [], 0.0
        for a, b in self.spans:
            if b < began or a > ended:
                kept.append((a, b))
            else:
                covered += min(b, ended) - max(a, began)
                lo, hi = min(lo, a), max(hi, b)
        self.spans = sorted([*kept, (lo, hi)])[-self.KEEP:]
        return (ended - began) - covered


class PrefixIndex:
    def __init__(self, fingerprint: str, ram_bytes: int, disk_dir: Path | None,
                 disk_bytes: int) -> None:
        self.fingerprint = fingerprint
        self.ram_cap, self.disk_cap = ram_bytes, disk_bytes
        self.dir = disk_dir
        self.entries: dict[str, Entry] = {}
        self.stats = CacheStats()
        self._next_ram_id = 1
        if disk_dir is not None:
            _private_dir(disk_dir)
            self._remove_stale_tmp()
            self._scan()

    def mark_features(self, tag: str) -> None:
        """Entries found on disk serve the draft if their feature rows are of its kind."""
        for e in self.entries.values():
            e.features = bool(tag) and e.feature_tag == tag

    # ---- structure ------------------------------------------------------------------------------
    def new_ram_id(self) -> int:
        self._next_ram_id += 1
        return self._next_ram_id

    def children(self, key: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.parent == key]

    def chain(self, entry: Entry) -> list[Entry]:
        """Root-first chain ending at `entry`, cut before the first missing link."""
        links = [entry]
        while links[-1].parent is not None:
            parent = self.entries.get(links[-1].parent)
            if parent is None or parent.length != links[-1].start:
                return []  # a broken chain: only its complete head is usable
            links.append(parent)
        return links[::-1]

    def lookup(self, keys: dict[int, str]) -> list[Entry]:
        """The chain of the longest cached prefix among `keys` (length -> key). A chain with a
        missing link is skipped, so a shorter candidate (the last good link) is found instead."""
        for length in sorted(keys, reverse=True):
            e = self.entries.get(keys[length])
            if e is not None and e.length == length:
                chain = self.chain(e)
                if chain:
                    return chain
        return []

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry

    def touch(self, entries: Iterable[Entry]) -> None:
        now = time.time()
        for e in entries:
            e.last_used = now
            if e.path is not None:
                try:
                    os.utime(e.path)  # recency survives restarts
                except OSError:
                    pass

    # ---- eviction --------------------------------------------------------------------------------
    def ram_bytes(self) -> int:
        return sum(e.kv_bytes for e in self.entries.values() if e.in_ram)

    def disk_bytes(self) -> int:
        return sum(e.path.stat().st_size for e in self.entries.values()
                   if e.path is not None and e.path.exists())

    def _evictable(self, e: Entry, keep_other_tier: bool) -> bool:
        return e.pins == 0 and not e.saving and (keep_other_tier or not self.children(e.key))

    def _drop_descendants(self, e: Entry, dropped: list[int]) -> bool:
        """Remove every descendant of `e` from every tier (leaves first), so `e` may leave a
        tier it alone holds. False if one of them is in use."""
        subtree, stack = [], list(self.children(e.key))
        while stack:
            x = stack.pop()
            subtree.append(x)
            stack.extend(self.children(x.key))
        if any(x.pins or x.saving for x in subtree):
            return False
        for x in reversed(subtree):
            if x.ram_id is not None:
                dropped.append(x.ram_id)
                self.stats.evicted_ram += 1
            if x.path is not None:
                self._unlink(x.path)
                self.stats.evicted_disk += 1
            self.entries.pop(x.key, None)
        return True

    def _unstick(self, tier: str, dropped: list[int]) -> bool:
        """When every entry of a tier is some child's only parent copy, evict the least
        recently used one's subtree so that the cap can still be met."""
        held = [e for e in self.entries.values() if (e.in_ram if tier == "ram" else
                e.path is not None) and not e.pins and not e.saving]
        for e in sorted(held, key=lambda e: e.last_used):
            if self._drop_descendants(e, dropped):
                return True
        return False

    def evictable_ram_ids(self) -> list[int]:
        """Snapshot ids `evict_ram` might drop: RAM copies not in use (a pinned or saving
        entry keeps its copy). A superset where the tree's order holds some back."""
        return [e.ram_id for e in self.entries.values()
                if e.in_ram and e.pins == 0 and not e.saving]

    def evict_ram_for(self, room: Callable[[list[int]], bool], extra: int = 0) -> list[int]:
        """`evict_ram(extra, room)`, but none at all where `room` would not hold even with
        every free RAM copy gone (host memory held by swapped-out sequences or copies in use):
        evicting would empty the tier for nothing."""
        if not room(self.evictable_ram_ids()):
            return []
        return self.evict_ram(extra=extra, room=room)

    def evict_ram(self, extra: int = 0,
                  room: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Snapshot ids to drop from the shards so the RAM tier fits its cap (`extra` more)
        and, with `room`, until `room(the ids dropped so far)` holds (the shards' host memory,
        shared with swapped-out sequences, has the room asked for: `runtime.host_pool`)."""
        dropped: list[int] = []
        while self.ram_bytes() + extra > self.ram_cap or (room is not None
                                                           and not room(dropped)):
            cands = sorted((e for e in self.entries.values() if e.in_ram and
                            self._evictable(e, e.path is not None)), key=lambda e: e.last_used)
            if not cands:
                if self._unstick("ram", dropped):
                    continue
                break
            e = cands[0]
            dropped.append(e.ram_id)
            e.ram_id = None
            self.stats.evicted_ram += 1
            if e.path is None:
                del self.entries[e.key]
        return dropped

    def evict_disk(self) -> list[int]:
        """Delete files so the disk tier fits its cap; returns snapshot ids of entries that
        had to go entirely (for the shards to drop)."""
        dropped: list[int] = []
        if self.dir is None:
            return dropped
        while self.disk_bytes() > self.disk_cap:
            cands = sorted((e for e in self.entries.values() if e.path is not None and
                            self._evictable(e, e.in_ram)), key=lambda e: e.last_used)
            if not cands:
                if self._unstick("disk", dropped):
                    continue
                break
            e = cands[0]
            self._unlink(e.path)
            e.path = None
            self.stats.evicted_disk += 1
            if not e.in_ram:
                del self.entries[e.key]
        return dropped

    # ---- disk directory --------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{key}{SUFFIX}"

    def tmp_path_for(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{key}.{os.getpid()}.tmp"

    def _remove_stale_tmp(self) -> None:
        """A writer holds an exclusive lock on its .tmp for its whole life: a .tmp we can lock
        belongs to a dead writer (another live server's files are left alone)."""
        for p in self.dir.glob("*.tmp"):
            try:
                with open(p, "rb") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    p.unlink()
                    log.info("removed the partial cache file %s of a dead writer", p.name)
            except BlockingIOError:
                pass
            except OSError:
                pass

    def _scan(self) -> None:
        """Rebuild the index from the entry files' headers (no tensor data is read)."""
        t0 = time.perf_counter()
        found = bad = other = 0
        for p in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                layout = read_layout(p)
            except KVFileError as e:
                self.quarantine(p, str(e))
                bad += 1
                continue
            m = layout.metadata
            if m.get("fingerprint") != self.fingerprint:
                other += 1
                continue
            try:
                e = Entry(key=m["key"], length=int(m["length"]), start=int(m["start"]),
                          parent=m["parent"] or None, tokens=(), logits=None,
                          kv_bytes=int(m["kv_bytes"]), path=p, last_used=p.stat().st_mtime,
                          feature_tag=m.get("features", ""))
            except (KeyError, ValueError, TypeError) as err:
                self.quarantine(p, f"metadata: {err}")
                bad += 1
                continue
            if p.name != f"{e.key}{SUFFIX}":
                self.quarantine(p, "file name does not match its key")
                bad += 1
                continue
            why = _inconsistent(layout, e)
            if why:
                self.quarantine(p, why)
                bad += 1
                continue
            self.entries[e.key] = e
            found += 1
        for e in list(self.entries.values()):  # links whose rows do not meet
            parent = self.entries.get(e.parent) if e.parent else None
            if parent is not None and parent.length != e.start:
                self.quarantine(e.path, f"its parent ends at row {parent.length}, it starts at "
                                        f"{e.start}")
                del self.entries[e.key]
                bad += 1
        orphans = [e for e in self.entries.values() if e.parent and e.parent not in self.entries]
        if orphans:
            log.warning("prefix cache: %d entries name a parent file that is missing (%s); "
                        "they restore only once it is written again", len(orphans),
                        ", ".join(e.path.name for e in orphans[:3]))
        log.info("prefix cache %s: %d entries (%d other models, %d bad) indexed in %.3f s",
                 self.dir, found, other, bad, time.perf_counter() - t0)

    def quarantine(self, path: Path, why: str) -> None:
        """Move a bad file aside (kept for inspection, never read again) and log why."""
        self.stats.bad_files += 1
        log.warning("prefix cache: %s is unusable (%s); moved aside", path.name, why)
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            self._unlink(path)

    @staticmethod
    def _unlink(path: Path | None) -> None:
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def drop_entry(self, e: Entry) -> list[Entry]:
        """Forget an entry whose file turned out bad and its now-stranded descendants; returns
        them all (their RAM copies and files are the caller's to release)."""
        stack, gone = [e], []
        while stack:
            x = stack.pop()
            if self.entries.pop(x.key, None) is not None:
                gone.append(x)
            stack.extend(self.children(x.key))
        return gone


def _inconsistent(layout, e: Entry) -> str:
    """What in an entry file's header contradicts itself ('' if nothing): the rows it holds,
    its parent link, the length of its tokens."""
    if not 0 <= e.start < e.length:
        return f"rows {e.start}:{e.length}"
    if (e.parent is None) != (e.start == 0):
        return f"starts at row {e.start} with{'out' if e.parent is None else ''} a parent"
    tokens = layout.tensors.get("tokens")
    if tokens is None or tokens.shape != (e.length,):
        return f"its tokens are not {e.length} long"
    for name, t in layout.tensors.items():  # K/V rows; a hybrid layer's state is whole
        if name.startswith("ls") and name.endswith((".k", ".v")) and (
                not t.shape or t.shape[0] != e.length - e.start):
            return f"{name} holds {t.shape[:1]} rows, not {e.length - e.start}"
    if e.kv_bytes < 0:
        return f"kv_bytes {e.kv_bytes}"
    return ""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def metadata_for(entry: Entry, fingerprint: str, kv_layout: list[dict], split: list[list[int]],
                 features: str = "") -> dict[str, str]:
    return {"fingerprint": fingerprint, "key": entry.key, "parent": entry.parent or "",
            "start": str(entry.start), "length": str(entry.length),
            "kv_bytes": str(entry.kv_bytes), "kv_layout": json.dumps(kv_layout),
            "split": json.dumps(split), "features": features}


def _private_dir(path: Path) -> None:
    """Create the cache directory 0700 (its entries are 0600: prompts can be read back from
    them); an existing one others can enter is used as it is, with a warning."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("prefix cache: %s is open to other users (mode %o): its entries hold "
                    "prompts; chmod 700 it", path, mode)
