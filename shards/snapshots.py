"""A process's prefix-cache memory: host copies of position-indexed rows (a shard's KV cache,
the draft process's feature rows), and their disk reads and writes.

The store serves named position-indexed rows: a shard's `k` and `v` (through the slots' block
tables of a paged cache, `shards.paged_kv.PagedRows`), the draft's `feat` (a tensor shaped (layers,
slots, max_len, ...), `TensorRows`). `take` copies rows [start, end) of every layer of every tensor
into a host buffer (pinned, on a side stream, on GPUs: decode goes on meanwhile; rows below the
prompt's end never change during decode), layer by layer. `restore` copies them back. `save` writes
them, from that same memory, into their places in an entry file the coordinator created (no staging
copy), in a background thread, each layer once it is copied, hashing while a writer thread
writes; `load` reads an entry file's rows for this shard's layers straight into the live KV cache
(CPU) or through one pinned buffer (GPU), verifying each tensor's checksum.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from layersplit.ipc.kv_file import checksum
from layersplit.ipc.messages import ProtocolError, message

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Snap:
    start: int
    end: int
    nbytes: int
    slot: int = 0  # the live slot the rows were taken from
    rows: dict[str, torch.Tensor] | None = None  # name -> (layers, rows, ...), host
    error: str | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    # while the copy runs: the host buffers, and how many layers of every tensor are in them
    host: dict[str, torch.Tensor] | None = None
    copied: int = 0
    progress: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def wait(self) -> None:
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError(f"snapshot copy failed: {self.error}")

    def wait_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The host buffers once every tensor's rows of `layer` are in them (-1: once they
        exist): a save writes the first layers while the later ones are still being copied."""
        with self.progress:
            self.progress.wait_for(lambda: self.ready.is_set() or (
                self.host is not None and self.copied > layer))
        if self.error is not None:
            raise RuntimeError(f"snapshot copy failed: {self.error}")
        if self.host is None or (self.rows is None and self.copied <= layer):  # (the copy's
            # thread ended early, without an error of its own)
            raise RuntimeError(f"snapshot copy ended before layer {layer} was copied")
        return self.host

    def advance(self, copied: int, host: dict[str, torch.Tensor] | None = None) -> None:
        with self.progress:
            if host is not None:
                self.host = host
            self.copied = copied
            self.progress.notify_all()

    def done(self) -> None:
        with self.progress:
            self.ready.set()
            self.progress.notify_all()


class TensorRows:
    """A (layers, slots, rows, ...) tensor as the store reads and writes it (the interface of
    `shards.paged_kv.PagedRows`)."""

    read_copies = False  # `read` gives a view of the live rows

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.layers, self.slots, self.max_len = t.shape[0], t.shape[1], t.shape[2]
        self.device, self.dtype = t.device, t.dtype

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """(layers, end - start, ...), a view of the live rows."""
        return self.t[:, slot, start:end]

    def write(self, slot: int, start: int, end: int, src: torch.Tensor,
              layer: int | None = None) -> None:
        dst = self.t[:, slot, start:end] if layer is None else self.t[layer, slot, start:end]
        dst.copy_(src, non_blocking=self.device.type == "cuda")

    def view(self, layer: int, slot: int, start: int, end: int) -> torch.Tensor:
        """The live rows of one layer, contiguous (a disk load reads straight into them)."""
        return self.t[layer, slot, start:end]

    def layer_shape(self, start: int, end: int) -> tuple[int, ...]:
        return (end - start, *self.t.shape[3:])


def _bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, any dtype."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class SnapshotStore:
    """`tensors`: position-indexed rows, (layers, slots, rows, ...). `whole`: a hybrid model's
    per-slot state, (layers, slots, ...), that holds the sequence up to its current position
    and changes with every step: a snapshot copies it whole, at once (the coordinator takes a
    snapshot right after the step that ends at its end), and a restore or load of a slot tells
    `forget` (verify rows pending on the slot are then void)."""

    def __init__(self, tensors: dict[str, Any], max_len: int | None = None,
                 whole: dict[str, torch.Tensor] | None = None,
                 forget: Callable[[int], None] | None = None) -> None:
        # name -> live rows: `TensorRows` (a plain tensor is wrapped) or `PagedRows`
        self.tensors = {name: TensorRows(t) if isinstance(t, torch.Tensor) else t
                        for name, t in tensors.items()}
        self.whole = whole or {}
        self.forget = forget or (lambda slot: None)
        first = next(iter(self.tensors.values()))
        self.max_len = first.max_len if max_len is None else max_len  # rows a snapshot may hold
        self.slots = first.slots
        self.device = first.device
        self.cuda = self.device.type == "cuda"
        self.entries: dict[int, Snap] = {}
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.results: queue.Queue = queue.Queue()  # finished saves, for the main loop
        self._staging: list[torch.Tensor | None] = [None, None]
        self._saves: list[threading.Thread] = []  # save threads (`saving`)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    # ---- RAM tier ---------------------------------------------------------------------------
    def take(self, entry: int, slot: int, start: int, end: int) -> int:
        """Start copying rows [start, end) out; returns at once (a background thread allocates
        the host buffers, pinned on GPUs, and copies). Rows below the prompt's end do not
        change while the sequence decodes, so the next steps need not wait."""
        if not 0 <= start < end <= self.max_len:
            raise ValueError(f"snapshot rows {start}:{end} outside the cache of {self.max_len}")
        self.check_slot(slot)
        srcs = {name: t.read(slot, start, end) for name, t in self.tensors.items()}
        # the state changes with the next step: copied now (on the device's stream)
        srcs.update({name: t[:, slot].clone() for name, t in self.whole.items()})
        snap = Snap(start, end, sum(t.numel() * t.element_size() for t in srcs.values()), slot)
        after = None
        if self.cuda:  # the copy must follow the step that wrote these rows
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))

        # on a CPU, a paged cache's rows (gathered through the block table) and the states are
        # already copies of their own: they are the snapshot
        own = set() if self.cuda else {name for name, t in self.tensors.items()
                                       if getattr(t, "read_copies", False)} | set(self.whole)
        layers = max((t.shape[0] for t in srcs.values()), default=0)

        def run() -> None:
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)
                rows = {name: t if name in own else
                        torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
                        for name, t in srcs.items()}
                snap.advance(0, rows)
                copy = [name for name in srcs if name not in own]
                # layer by layer, so that a save can write each layer as soon as it is here
                if self.cuda:
                    copied = []
                    with torch.cuda.stream(self.copy_stream):
                        self.copy_stream.wait_event(after)
                        for layer in range(layers):
                            for name in copy:
                                if layer < srcs[name].shape[0]:
                                    rows[name][layer].copy_(srcs[name][layer], non_blocking=True)
                            copied.append(torch.cuda.Event())
                            copied[-1].record(self.copy_stream)
                    for layer, ev in enumerate(copied):
                        ev.synchronize()
                        snap.advance(layer + 1)
                else:
                    for layer in range(layers):
                        for name in copy:
                            if layer < srcs[name].shape[0]:
                                rows[name][layer].copy_(srcs[name][layer])
                        snap.advance(layer + 1)
                snap.rows = rows
            except Exception as e:  # noqa: BLE001 - surfaces at restore/save
                snap.error = f"{type(e).__name__}: {e}"
            finally:
                snap.done()

        self.entries[entry] = snap
        threading.Thread(target=run, name=f"snap-{entry}", daemon=True).start()
        return snap.nbytes

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside the {self.slots} slots of this cache")

    def pending_end(self, slot: int) -> int:
        """Highest row end of `slot`'s snapshots whose copy has not finished (0 if none)."""
        return max((s.end for s in self.entries.values()
                    if s.slot == slot and not s.ready.is_set()), default=0)

    def wait_pending(self) -> None:
        """Until every started copy is done (before the live rows they read are rewritten)."""
        for s in list(self.entries.values()):
            s.ready.wait()

    def restore(self, entry: int, slot: int, sync: bool = True) -> None:
        """Copy the entry's rows back into `slot`; on a GPU, done when this returns unless
        `sync` is False (`snap_op` restores a chain of entries, then waits once)."""
        self.check_slot(slot)
        s = self.entries[entry]
        s.wait()
        assert s.rows is not None
        for name, t in self.tensors.items():
            t.write(slot, s.start, s.end, s.rows[name])
        for name, t in self.whole.items():
            t[:, slot].copy_(s.rows[name], non_blocking=self.cuda)
        self.forget(slot)
        if self.cuda and sync:
            torch.cuda.current_stream(self.device).synchronize()

    def drop(self, entry: int) -> None:
        self.entries.pop(entry, None)

    # ---- disk tier --------------------------------------------------------------------------
    def save(self, entry: int, path: str, items: list[dict[str, Any]],
             stream: bool = False) -> None:
        """Write this shard's tensors of `entry` into `path` at their offsets, in the background.
        items: {name, layer (local index), kind (a tensor name), offset}. The outcome goes to
        `results` as (entry, path, checksums or None, error or None, streamed, seconds waited
        for the snapshot's host copy): with `stream`
        nothing is written here and `streamed` holds the tensors' bytes (views of the
        snapshot's host rows, no copy) for the coordinator to write, in item order."""
        snap = self.entries[entry]

        waited = [0.0]  # seconds spent waiting for the snapshot's host copy

        def wait_layer(layer: int) -> dict[str, torch.Tensor]:
            t0 = time.perf_counter()
            try:
                return snap.wait_layer(layer)
            finally:
                waited[0] += time.perf_counter() - t0

        def run() -> None:
            try:
                if stream:
                    wait_layer(max((it["layer"] for it in items), default=0))
                host = wait_layer(-1)
                views = [_bytes(host[it["kind"]][it["layer"]]) for it in items]
                if stream:
                    sums = {it["name"]: checksum(v) for it, v in zip(items, views)}
                    self.results.put((entry, path, sums, None, views, waited[0]))
                    return
                sums = write_hashed(path, [it["offset"] for it in items], views,
                                    [it["name"] for it in items],
                                    lambda i: wait_layer(items[i]["layer"]))
                self.results.put((entry, path, sums, None, [], waited[0]))
            except Exception as e:  # noqa: BLE001 - reported to the coordinator
                self.results.put((entry, path, None, f"{type(e).__name__}: {e}", [],
                                  waited[0]))

        th = threading.Thread(target=run, name=f"save-{entry}", daemon=True)
        self._saves = [t for t in self._saves if t.is_alive()] + [th]
        th.start()

    @property
    def saving(self) -> bool:
        """A save's thread is at work, or its outcome waits in `results`."""
        return any(t.is_alive() for t in self._saves) or not self.results.empty()

    def load(self, path: str | None, slot: int, items: list[dict[str, Any]],
             frames: list[Any] | None = None) -> int:
        """Read rows into the live tensors, verifying checksums. items: {name, layer (local),
        kind, offset, nbytes, start, end, checksum}. The bytes come from the file at `path`, or
        from `frames` (one per item, sent by the coordinator when this shard cannot reach the
        file). Returns bytes read; raises on a mismatch (rows read so far are then garbage
        above the last good link, which is harmless: the prefill that follows overwrites them).

        Pipelined: a reader thread fetches tensor i+1 while tensor i is hashed (and, on a GPU,
        copied to the device from one of two pinned buffers)."""
        self.check_slot(slot)
        self.forget(slot)
        dsts, later = [], []  # later: (rows, layer, start, end, buffer) written once all is read
        for it in items:
            if it["kind"] in self.whole:  # a state: the file holds it whole
                dst = self.whole[it["kind"]][it["layer"], slot]
            else:
                rows = self.tensors[it["kind"]]
                if not 0 <= it["start"] <= it["end"] <= self.max_len:
                    raise ValueError(f"{it['name']}: rows {it['start']}:{it['end']} outside the "
                                     f"cache of {self.max_len}")
                dst = rows.view(it["layer"], slot, it["start"], it["end"])
                if dst is None:  # paged: read into a buffer, then through the block table
                    dst = torch.empty(rows.layer_shape(it["start"], it["end"]),
                                      dtype=rows.dtype, device=rows.device)
                    later.append((rows, it["layer"], it["start"], it["end"], dst))
            if dst.numel() * dst.element_size() != it["nbytes"]:
                raise ValueError(f"{it['name']}: {it['nbytes']} bytes in the file, "
                                 f"{dst.numel() * dst.element_size()} expected by this shard")
            dsts.append(dst)
        if frames is not None and len(frames) != len(items):
            raise ValueError(f"{len(frames)} tensors streamed for {len(items)} items")
        fd = os.open(path, os.O_RDONLY) if frames is None else -1
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
                if frames is not None:
                    got = len(frames[i])
                    if got == it["nbytes"]:
                        view[:] = frames[i]
                else:
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
            for rows, layer, start, end, buf in later:
                rows.write(slot, start, end, buf, layer)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            if nxt is not None:
                try:
                    nxt.result()
                except Exception:  # noqa: BLE001 - the first error was already raised
                    pass
            pool.shutdown()
            if fd >= 0:
                os.close(fd)
        return sum(it["nbytes"] for it in items)

    def _stage(self, which: int, nbytes: int) -> torch.Tensor:
        if self._staging[which] is None or self._staging[which].numel() < nbytes:
            self._staging[which] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[which][:nbytes]


def write_hashed(path: str, offsets: list[int], views: list[memoryview], names: list[str],
                 before: Callable[[int], Any] | None = None) -> dict[str, str]:
    """Write each buffer at its offset of the file at `path` and return name -> checksum;
    `before(i)`, if given, returns once buffer i holds its bytes (buffers are taken in order).

    The checksums are computed on this thread while a writer thread writes the same buffers (the
    hash holds the GIL, the write does not), so a save takes about as long as its writes alone.
    Small buffers that lie back to back in the file go down together in one `pwritev`."""
    runs: list[list[int]] = []  # indices of buffers that lie back to back in the file
    size = 0
    for i, (off, v) in enumerate(zip(offsets, views)):
        if runs and offsets[runs[-1][0]] + size == off and size + len(v) <= WRITEV_BYTES \
                and len(runs[-1]) < WRITEV_MAX:
            runs[-1].append(i)
            size += len(v)
        else:
            runs.append([i])
            size = len(v)
    fd = os.open(path, os.O_WRONLY)
    pool = ThreadPoolExecutor(1, thread_name_prefix="save-write")
    writes: list[Any] = []
    try:
        sums = {}
        for run in runs:
            if before is not None:
                for i in run:
                    before(i)
            writes.append(pool.submit(_pwrite_all, fd, [views[i] for i in run], offsets[run[0]]))
            for i in run:
                sums[names[i]] = checksum(views[i])
        for w in writes:
            w.result()
        return sums
    finally:
        for w in writes:  # (after an error: the writes not yet started are not made)
            w.cancel()
        pool.shutdown(wait=True)
        os.close(fd)


WRITEV_MAX = 64  # buffers per pwritev (well under IOV_MAX)
WRITEV_BYTES = 16 << 20  # small tensors are gathered up to this much per call; not more, so the
# other shards' writes into the same file (one inode lock) interleave with this one's


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """pwritev `bufs` back to back from `offset`, going on after a partial write."""
    want = sum(len(b) for b in bufs)
    done = 0
    while done < want:
        rest, skip = [], done
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(b[skip:])
            skip = 0
        n = os.pwritev(fd, rest, offset + done)
        if n <= 0:
            raise OSError(f"short write ({done} of {want} bytes at offset {offset})")
        done += n
    start_writeback(fd, offset, want)


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):  # (not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing bytes [offset, offset + nbytes) of `fd` to the disk now
    (Linux `sync_file_range`, a hint, not durability: the save's fsync still makes the file
    durable), so the disk writes while the rest of the file is still being written and the
    final fsync waits for little more than the last range; without it they all wait for it."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # (an error: the fsync's)


def check_items(store: SnapshotStore, items: Any) -> list[dict[str, Any]]:
    """Validate the file items of a snap_save / snap_load against this store's tensors."""
    if not isinstance(items, list):
        raise ValueError("cache-file items must be a list")
    for it in items:
        kind = it.get("kind") if isinstance(it, dict) else None
        t = store.tensors.get(kind, store.whole.get(kind)) if isinstance(kind, str) else None
        layers = t.shape[0] if isinstance(t, torch.Tensor) else getattr(t, "layers", 0)
        if t is None or not isinstance(it.get("layer"), int) or \
                not 0 <= it["layer"] < layers or \
                not isinstance(it.get("offset"), int) or it["offset"] < 0:
            raise ValueError(f"bad cache-file item {it!r}")
    return items


def entry_path_ok(path: str, cache_dir: str | None) -> bool:
    """Shards only touch files inside the cache directory they were configured with."""
    if cache_dir is None:
        return False
    p, d = Path(path).resolve(), Path(cache_dir).resolve()
    return d in p.parents


def report_saves(store: SnapshotStore | None,
                 send: Callable[[dict[str, Any], list[Any]], None]) -> bool:
    """Hand `send` a `saved` message (and, for a streamed save, its tensors as frames) for each
    disk write the background threads finished; True if there was any."""
    if store is None or store.results.empty():
        return False
    while not store.results.empty():
        entry, path, sums, err, streamed, waited = store.results.get_nowait()
        names = list(sums) if streamed else []  # the frames' order (dicts keep insertion order)
        send(message("saved", entry=entry, path=path, checksums=sums, error=err, names=names,
                     copy_wait_s=waited), streamed)
    return True


SAVE_POLL_MS = 2  # an idle process with a save in flight blocks at most this long


def block_ms(store: SnapshotStore | None, timeout_ms: int) -> int:
    """How long an idle main loop may block on its sockets: while a save is in flight, no
    more than `SAVE_POLL_MS`, so its outcome goes to the coordinator as it is ready (the file's
    rename waits for it), not after an idle process's longest sleep (`ipc.serve_loop`)."""
    return min(timeout_ms, SAVE_POLL_MS) if store is not None and store.saving else timeout_ms


SNAP_OPS = ("snap_take", "snap_restore", "snap_drop", "snap_save", "snap_load")


def snap_op(store: SnapshotStore, msg: dict[str, Any], cache_dir: str | None,
            frames: list[Any] = ()) -> dict[str, Any]:
    """Carry out one prefix-cache message (`SNAP_OPS`) on `store`; returns the info of its `ok`
    reply. A request that cannot be right raises ProtocolError; an unreadable file is reported
    in the info (`error`), as a miss, not as a protocol failure. A streamed `snap_load`
    carries its tensors in `frames`."""
    t = msg["type"]
    if frames and not (t == "snap_load" and msg["stream"]):
        raise ProtocolError(f"{t}: unexpected payload frames")
    if t == "snap_take":
        return {"bytes": store.take(msg["entry"], msg["slot"], msg["start"], msg["end"])}
    if t == "snap_drop":
        for e in msg["entries"]:
            store.drop(e)
        return {"bytes": store.nbytes}
    if t == "snap_restore":
        missing = [e for e in msg["entries"] if e not in store.entries]
        if missing:
            raise ProtocolError(f"snap_restore: no snapshot {missing[0]} here", "unknown_entry")
        store.wait_pending()
        for e in msg["entries"]:
            store.restore(e, msg["slot"], sync=False)
        if store.cuda:  # (one wait for the chain's copies, not one an entry)
            torch.cuda.current_stream(store.device).synchronize()
        return {}
    if not msg["stream"] and not entry_path_ok(msg["path"], cache_dir):
        raise ProtocolError(f"{msg['path']} is outside the cache directory", "bad_path")
    try:
        items = check_items(store, msg["items"])
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if t == "snap_save":
        if msg["entry"] not in store.entries:
            raise ProtocolError(f"snap_save: no snapshot {msg['entry']}", "unknown_entry")
        store.save(msg["entry"], msg["path"], items, stream=msg["stream"])
        return {}
    store.wait_pending()
    try:
        if msg["stream"]:
            return {"bytes": store.load(None, msg["slot"], items, [f.buffer for f in frames])}
        return {"bytes": store.load(msg["path"], msg["slot"], items)}
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
