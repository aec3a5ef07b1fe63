"""A shard's prefix-cache memory: host copies of KV rows, and their disk reads and writes.

`take` copies rows [start, end) of every local layer out of the live KV cache into a host
buffer (pinned, on a side stream, on GPUs: decode goes on meanwhile; rows below the prompt's
end never change during decode). `restore` copies them back. `save` writes them, from that
same memory, into their places in an entry file the coordinator created (no staging copy), in a
background thread; `load` reads an entry file's rows for this shard's layers straight into the
live KV cache (CPU) or through one pinned buffer (GPU), verifying each tensor's checksum.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ipc.kv_file import checksum
from shards.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Snap:
    start: int
    end: int
    nbytes: int
    k: torch.Tensor | None = None  # (layers, rows, kv_heads, head_dim), host
    v: torch.Tensor | None = None
    error: str | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)

    def wait(self) -> None:
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError(f"snapshot copy failed: {self.error}")


def _bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, any dtype."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class SnapshotStore:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.device = kv.k.device
        self.cuda = self.device.type == "cuda"
        self.entries: dict[int, Snap] = {}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.results: queue.Queue = queue.Queue()  # finished saves, for the main loop
        self._staging: list[torch.Tensor | None] = [None, None]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    # ---- RAM tier ---------------------------------------------------------------------------
    def take(self, entry: int, slot: int, start: int, end: int) -> int:
        """Start copying rows [start, end) out; returns at once (a background thread allocates
        the host buffers, pinned on GPUs, and copies). Rows below the prompt's end do not
        change while the sequence decodes, so the next steps need not wait."""
        if not 0 <= start < end <= self.kv.max_len:
            raise ValueError(f"snapshot rows {start}:{end} outside the KV cache")
        src_k, src_v = self.kv.k[:, slot, start:end], self.kv.v[:, slot, start:end]
        snap = Snap(start, end, 2 * src_k.numel() * src_k.element_size())
        after = None
        if self.cuda:  # the copy must follow the step that wrote these rows
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))

        def run() -> None:
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)
                k = torch.empty(src_k.shape, dtype=src_k.dtype, pin_memory=self.cuda)
                v = torch.empty(src_v.shape, dtype=src_v.dtype, pin_memory=self.cuda)
                if self.cuda:
                    with torch.cuda.stream(self.copy_stream):
                        self.copy_stream.wait_event(after)
                        k.copy_(src_k, non_blocking=True)
                        v.copy_(src_v, non_blocking=True)
                    self.copy_stream.synchronize()
                else:
                    k.copy_(src_k)
                    v.copy_(src_v)
                snap.k, snap.v = k, v
            except Exception as e:  # noqa: BLE001 - surfaces at restore/save
                snap.error = f"{type(e).__name__}: {e}"
            finally:
                snap.ready.set()

        self.entries[entry] = snap
        threading.Thread(target=run, name=f"snap-{entry}", daemon=True).start()
        return snap.nbytes

    def pending_end(self) -> int:
        """Highest row end of snapshots whose copy has not finished (0 if none)."""
        return max((s.end for s in self.entries.values() if not s.ready.is_set()), default=0)

    def wait_pending(self) -> None:
        """Until every started copy is done (before the live rows they read are rewritten)."""
        for s in list(self.entries.values()):
            s.ready.wait()

    def restore(self, entry: int, slot: int) -> None:
        s = self.entries[entry]
        s.wait()
        assert s.k is not None and s.v is not None
        self.kv.k[:, slot, s.start:s.end].copy_(s.k, non_blocking=self.cuda)
        self.kv.v[:, slot, s.start:s.end].copy_(s.v, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def drop(self, entry: int) -> None:
        self.entries.pop(entry, None)

    # ---- disk tier --------------------------------------------------------------------------
    def save(self, entry: int, path: str, items: list[dict[str, Any]]) -> None:
        """Write this shard's tensors of `entry` into `path` at their offsets, in the background.
        items: {name, layer (local index), kind 'k'|'v', offset}. The outcome goes to
        `results` as (entry, path, checksums or None, error or None)."""
        snap = self.entries[entry]

        def run() -> None:
            try:
                snap.wait()
                assert snap.k is not None and snap.v is not None
                sums = {}
                fd = os.open(path, os.O_WRONLY)
                try:
                    for it in items:
                        t = (snap.k if it["kind"] == "k" else snap.v)[it["layer"]]
                        data = _bytes(t)
                        written = os.pwrite(fd, data, it["offset"])
                        if written != len(data):
                            raise OSError(f"short write ({written} of {len(data)} bytes)")
                        sums[it["name"]] = checksum(data)
                finally:
                    os.close(fd)
                self.results.put((entry, path, sums, None))
            except Exception as e:  # noqa: BLE001 - reported to the coordinator
                self.results.put((entry, path, None, f"{type(e).__name__}: {e}"))

        threading.Thread(target=run, name=f"save-{entry}", daemon=True).start()

    def load(self, path: str, slot: int, items: list[dict[str, Any]]) -> int:
        """Read rows into the live KV cache, verifying checksums. items: {name, layer (local),
        kind, offset, nbytes, start, end, checksum}. Returns bytes read; raises on a mismatch
        (rows read so far are then garbage above the last good link, which is harmless: the
        prefill that follows overwrites them).

        Pipelined: a reader thread fetches tensor i+1 while tensor i is hashed (and, on a GPU,
        copied to the device from one of two pinned buffers)."""
        dsts = []
        for it in items:
            dst = (self.kv.k if it["kind"] == "k" else self.kv.v)[it["layer"], slot,
                                                                  it["start"]:it["end"]]
            if dst.numel() * dst.element_size() != it["nbytes"]:
                raise ValueError(f"{it['name']}: {it['nbytes']} bytes in the file, "
                                 f"{dst.numel() * dst.element_size()} expected by this shard")
            dsts.append(dst)
        fd = os.open(path, os.O_RDONLY)
        pool = ThreadPoolExecutor(1)
        events: list[Any] = [None, None]
        try:
            def fetch(i: int) -> memoryview:
                it = items[i]
                if self.cuda:
                    if events[i % 2] is not None:
                        events[i % 2].synchronize()  # the buffer's last copy has left
                    view = _bytes(self._stage(i % 2, it["nbytes"]))
                else:
                    view = _bytes(dsts[i])
                got = os.preadv(fd, [view], it["offset"])
                if got != it["nbytes"]:
                    raise ValueError(f"{it['name']}: short read ({got} of {it['nbytes']} bytes)")
                return view

            nxt = pool.submit(fetch, 0) if items else None
            for i, it in enumerate(items):
                view = nxt.result()
                nxt = pool.submit(fetch, i + 1) if i + 1 < len(items) else None
                if checksum(view) != it["checksum"]:
                    raise ValueError(f"{it['name']}: checksum mismatch")
                if self.cuda:
                    src = self._staging[i % 2][:it["nbytes"]]
                    dsts[i].view(torch.uint8).reshape(-1).copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
                    events[i % 2] = ev
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            if nxt is not None:
                try:
                    nxt.result()
                except Exception:  # noqa: BLE001 - the first error was already raised
                    pass
            pool.shutdown()
            os.close(fd)
        return sum(it["nbytes"] for it in items)

    def _stage(self, which: int, nbytes: int) -> torch.Tensor:
        if self._staging[which] is None or self._staging[which].numel() < nbytes:
            self._staging[which] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[which][:nbytes]


def entry_path_ok(path: str, cache_dir: str | None) -> bool:
    """Shards only touch files inside the cache directory they were configured with."""
    if cache_dir is None:
        return False
    p, d = Path(path).resolve(), Path(cache_dir).resolve()
    return d in p.parents
