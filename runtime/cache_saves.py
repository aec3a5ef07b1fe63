"""The prefix cache's disk saves in flight (`runtime.cache_ops.CacheManager` starts them).

A save's file is `<key>.<pid>.tmp`, made by the coordinator at its final size; every shard (and
the draft, for its feature rows) writes its own tensors into it, or streams them back to be
written here, and reports checksums (`on_saved`). Once all have, a finalizer thread fills in
the checksums, fsyncs, renames the file into place and fsyncs the directory; a delta entry's
file goes in place only after its parent's. The main thread applies finished saves to the index
(`poll_done`); `pending` is what an idle engine polls while files are being written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from layersplit.ipc.kv_file import FEATURE_DATA, FEATURE_META, checksum, write_header
from layersplit.ipc.messages import ProtocolError, optional_seconds
from layersplit.runtime.prefix_cache import BusySpans, PrefixIndex, SaveJob, fsync_dir

log = logging.getLogger(__name__)

PARENT_WAIT_S = 120.0  # a delta entry's save waits this long for its parent's file


def discard(job: SaveJob) -> None:
    """A save that will not complete: its partial file removed, its entry no longer saving."""
    job.renamed.set()  # (not ok: a child waiting for it is not saved either)
    job.entry.saving = False
    with contextlib.suppress(OSError):  # (closed already)
        os.close(job.fd)
    job.tmp.unlink(missing_ok=True)


def take_streamed(job: SaveJob, shard: int, msg: dict[str, Any],
                  frames: Sequence[Any]) -> str | None:
    """Keep the tensors a streaming shard sent for the file (written by `DiskSaves._finalize`);
    why they cannot be taken, if so. Each must be the tensor it names, whole, with the checksum
    the shard reported (which the file's header then records)."""
    want = job.streamed_names.get(shard, [])
    if msg["names"] != want or len(frames) != len(want):
        return (f"sent {len(frames)} tensors named {msg['names'][:3]}..., expected "
                f"{len(want)} ({want[:3]}...)")
    sums = msg["checksums"] or {}
    for name, frame in zip(want, frames):
        data = frame.buffer if hasattr(frame, "buffer") else frame
        if len(data) != job.layout.tensors[name].nbytes:
            return (f"{name}: {len(data)} bytes, the file holds "
                    f"{job.layout.tensors[name].nbytes}")
        if sums.get(name) != checksum(data):
            return f"{name}: the bytes sent do not match their checksum"
        job.streamed.append((job.layout.offset(name), data))
    return None


class DiskSaves:
    """The saves in flight of one prefix cache (`index`): `entry_bytes(rows)` prices an entry
    saved without its feature rows; `applied()` runs after `poll_done` changed the index (the
    caller's caps)."""

    def __init__(self, index: PrefixIndex, entry_bytes: Callable[[int], int],
                 applied: Callable[[], None]) -> None:
        self.index = index
        self.stats = index.stats
        self.entry_bytes = entry_bytes
        self.applied = applied
        self.jobs: dict[int, SaveJob] = {}  # by the entry's RAM id, until every writer answered
        self.by_key: dict[str, SaveJob] = {}  # saves in progress, by entry key
        self.failed: set[str] = set()  # keys whose save failed (their children fail too)
        self.done: queue.Queue = queue.Queue()
        self.spans = BusySpans()  # (perf_counter) the saves in stats.save_wall_s
        self._threads: list[threading.Thread] = []

    def add(self, job: SaveJob) -> None:
        """A save whose file is made: its writers answer through `on_saved` (a key saved again
        after a failed save: a delta entry after it waits for this one)."""
        self.jobs[job.entry.ram_id] = job
        self.by_key[job.entry.key] = job
        self.failed.discard(job.entry.key)
        job.entry.saving = True

    def cancel(self, job: SaveJob) -> None:
        """A save whose start failed."""
        self.jobs.pop(job.entry.ram_id, None)
        self._end(job)

    def abandon(self) -> None:
        """Saves that can no longer complete (shards gone): remove their partial files."""
        for job in list(self.jobs.values()):
            self._end(job)
        self.jobs.clear()

    def _end(self, job: SaveJob) -> None:
        """A save that never reached its finalizer: discarded, its key failed (a delta entry
        saved after it must not go in place without its parent's file) and not held."""
        discard(job)
        self.failed.add(job.entry.key)
        if self.by_key.get(job.entry.key) is job:
            del self.by_key[job.entry.key]

    def draft_lost(self) -> None:
        """The draft is gone: saves waiting for its feature rows finish without them."""
        for ram_id, job in list(self.jobs.items()):
            if -1 in job.waiting:
                self.on_saved(-1, {"entry": ram_id, "path": str(job.tmp), "checksums": None,
                                   "error": "the draft process is gone"})

    def on_saved(self, shard: int, msg: dict[str, Any], frames: Sequence[Any] = ()) -> None:
        """A writer's answer (`shard` -1: the draft's); the last one starts the finalizer."""
        job = self.jobs.get(msg["entry"])
        if job is None or shard not in job.waiting or msg["path"] != str(job.tmp):
            return  # not one of this run's saves (e.g. a remote shard's earlier run)
        job.waiting.discard(shard)
        try:
            job.copy_wait_s = max(job.copy_wait_s, optional_seconds(msg, "copy_wait_s"))
        except ProtocolError as e:  # (a statistic only: the save goes on)
            log.warning("prefix cache: shard %d's save: %s", shard, e)
        if not msg["error"]:
            why = take_streamed(job, shard, msg, frames)
            if why is not None:
                msg = {**msg, "error": why}
        if msg["error"] and shard < 0:  # the KV is still good: keep it, without the features
            log.warning("prefix cache: %s is saved without its draft feature rows: %s",
                        job.entry.key[:12], msg["error"])
            job.without_features = True
            e = job.entry
            e.features = False
            e.kv_bytes = self.entry_bytes(e.length - e.start)
        elif msg["error"]:
            job.failed = f"shard {shard}: {msg['error']}"
        else:
            job.sums.update(msg["checksums"])
        if not job.waiting:
            del self.jobs[msg["entry"]]
            th = threading.Thread(target=self._finalize, args=(job,), daemon=True)
            th.start()
            self._threads.append(th)

    def _finalize(self, job: SaveJob) -> None:
        """Streamed tensors and checksums in, fsync, atomic rename, directory fsync (a
        background thread)."""
        final = self.index.path_for(job.entry.key)
        try:
            if job.failed:
                raise OSError(job.failed)
            for offset, data in job.streamed:
                if os.pwrite(job.fd, data, offset) != len(data):
                    raise OSError(f"short write at offset {offset}")
            job.streamed.clear()
            if job.without_features:  # they are the file's last tensors: cut them off
                for name in (FEATURE_META, FEATURE_DATA):
                    job.layout.tensors.pop(name, None)
                    job.sums.pop(name, None)
                job.layout.metadata.update(features="", kv_bytes=str(job.entry.kv_bytes))
                os.ftruncate(job.fd, job.layout.file_size)
            job.layout.checksums = job.sums
            with os.fdopen(os.dup(job.fd), "r+b") as f:
                write_header(f, job.layout)
                f.flush()
            os.fsync(job.fd)
            # a delta entry goes in place after its parent (a kill between the two renames
            # leaves no entry whose parent is missing); not at all if the parent's save failed
            parent = self.by_key.get(job.entry.parent or "")
            if job.entry.parent in self.failed or (
                    parent is not None and parent is not job and (
                        not parent.renamed.wait(PARENT_WAIT_S) or not parent.ok)):
                raise OSError(f"its parent entry {job.entry.parent[:12]} was not saved")
            os.replace(job.tmp, final)
            fsync_dir(final.parent)
            job.ok = True
            self.done.put((job.entry, final, job.layout.file_size, None,
                           (job.started, time.perf_counter(), job.copy_wait_s)))
        except Exception as err:  # noqa: BLE001 - reported; the entry stays RAM-only
            job.tmp.unlink(missing_ok=True)
            self.done.put((job.entry, None, 0, str(err), (0.0, 0.0, 0.0)))
        finally:
            os.close(job.fd)  # releases the writer's lock
            if not job.ok:
                self.failed.add(job.entry.key)
            job.renamed.set()  # (a child that found it in by_key waits on this)
            if self.by_key.get(job.entry.key) is job:  # not kept for the run's life
                del self.by_key[job.entry.key]

    def poll_done(self) -> None:
        """Apply finished saves to the index (main thread only), then `applied`."""
        changed = False
        while not self.done.empty():
            e, path, size, err, (began, ended, copy_wait) = self.done.get_nowait()
            e.saving = False
            if self.index.entries.get(e.key) is not e:  # dropped meanwhile: file unreachable
                if path is not None:
                    path.unlink(missing_ok=True)
                continue
            changed = True
            if err is not None:
                self.stats.save_errors += 1
                log.warning("prefix cache: saving %s failed: %s", e.key[:12], err)
                continue
            e.path = path
            st = self.stats
            st.saves, st.bytes_written, st.save_s = st.saves + 1, st.bytes_written + size, \
                st.save_s + ended - began
            st.save_copy_wait_s += copy_wait
            st.save_wall_s += self.spans.add(began, ended)  # (they end in any order)
        if changed:
            self.applied()

    def pending(self) -> int:
        """Saves not in the index yet: waiting for rows, being written, or not yet applied
        (`poll_done`). Ended writer threads are let go (an idle engine asks every SAVE_POLL_S)."""
        self._threads = [th for th in self._threads if th.is_alive()]
        return len(self.jobs) + len(self._threads) + self.done.qsize()
