"""The host-memory tier of live KV: a shard's swapped-out blocks (swap preemption,
`runtime.batching`; message `kv_swap`, `shards.worker_cache.ShardCacheOps._on_kv_swap`).

Up to `num_blocks` blocks shaped like the device pool's. Block ids are the coordinator's (its
host `BlockManager`), the same on every shard. Memory is taken when blocks are swapped out
(one buffer of exactly the swap's blocks) and given back when the last block of a buffer is
swapped in or dropped, so the shard holds what the coordinator's ledger of its host memory
counts (`runtime.host_pool`, shared with the prefix cache's RAM-tier snapshots); on a GPU a
buffer whose copies are still running goes a little after its ledger entry (`reap`: at the
drop when they ran long ago, else at the next step or swap).

**On a GPU the copies are asynchronous.** They run on a copy stream of their own, after
every kernel queued before the swap (the steps that wrote the rows), and every kernel queued
after it waits for them on the GPU (`_copies`); the host does not wait, so the handler replies
once they are queued and the coordinator goes on while the rows move: the step that reads a
swapped-in sequence's rows runs after they land, and the steps that reuse a swapped-out
sequence's device blocks run only once its rows are read (frees wait on the GPU, not on the
host). A buffer is page-locked (`cudaHostRegister`: exactly its bytes, where torch's pinned
allocator would round each one up to a power of two and keep it cached), so the copies are
DMA at full bus speed and truly asynchronous; it is unregistered and freed only once the
copies that use it have run (`reap`). Copies go through a fixed device staging buffer of up
to `STAGE_BYTES` (rows of scattered blocks are gathered there, then copied in one piece), so a
swap of any size needs no device memory beyond it. Page-locking a new buffer is the part the
host waits for (about 0.4 s per GB on an H100: `bench/kv_swap.py`). On the CPU, the same code
copies synchronously into plain memory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from layersplit.shards.device import to_device
from layersplit.shards.paged_kv import PagedKVCache

log = logging.getLogger(__name__)

STAGE_BYTES = 64 << 20  # device staging for one piece of a swap (K and V of its blocks)


class HostKVPool:
    def __init__(self, kv: PagedKVCache, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"host KV pool: {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.kv = kv
        # host block -> (its swap's buffer (2, n, layers, block, kv_heads, head_dim): K and V
        # of n blocks, block-major, so a run of blocks is one contiguous copy), index in it)
        self.held: dict[int, tuple[torch.Tensor, int]] = {}
        # buffers no block holds any more, with the copy-stream event after their last copy:
        # unregistered and freed once it has run
        self.retiring: list[tuple[torch.Tensor, Any]] = []
        self.registered: set[int] = set()  # data_ptr of the page-locked buffers
        block = kv.k_store[:, 0]  # (layers, block, kv_heads, head_dim)
        self.block_shape = tuple(block.shape)
        self.block_bytes = 2 * block.numel() * block.element_size()
        self.stage_blocks = max(1, min(num_blocks, STAGE_BYTES // self.block_bytes))
        # the copies' stream, on a GPU (None: the CPU, where they simply run)
        self.stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None
        self.stage: torch.Tensor | None = None  # device staging (`_copies`, on a GPU)

    @property
    def nbytes(self) -> int:
        """Host bytes held now (the buffers of held blocks, and those whose last copy may
        still be running)."""
        live = {b.data_ptr(): b for b, _ in self.held.values()}
        live.update((b.data_ptr(), b) for b, _ in self.retiring)
        return sum(b.numel() * b.element_size() for b in live.values())

    def pairs_error(self, kv: PagedKVCache, pairs: Any, direction: str = "out") -> str | None:
        """Why `pairs` is not a list of [device block, host block] pairs of this pool and
        `kv`'s (each id in range, no device or host block twice; "in" names only blocks the
        pool holds; "drop" no device block, -1, and any host block: one that holds nothing
        stays so, as after a swap-out that failed on this shard), or None."""
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and
                all(isinstance(b, int) and not isinstance(b, bool) for b in p) for p in pairs):
            return f"pairs must be a list of [device block, host block], got {str(pairs)[:120]}"
        low = -1 if direction == "drop" else 0
        high = 0 if direction == "drop" else kv.num_blocks
        bad = next((p for p in pairs if not (low <= p[0] < high and
                                             0 <= p[1] < self.num_blocks)), None)
        if bad is not None:
            if direction == "drop":
                return f"drop pair {bad} is not [-1, host block 0..{self.num_blocks - 1}]"
            return (f"pair {bad} outside device blocks 0..{kv.num_blocks - 1} or host blocks "
                    f"0..{self.num_blocks - 1}")
        if direction != "drop" and len({p[0] for p in pairs}) != len(pairs):
            return "pairs list a device block twice"
        if len({p[1] for p in pairs}) != len(pairs):
            return "pairs list a host block twice"
        if direction == "out":
            taken = next((p[1] for p in pairs if p[1] in self.held), None)
            if taken is not None:
                return f"host block {taken} already holds a swapped-out block"
        empty = next((p[1] for p in pairs if p[1] not in self.held), None)
        if direction == "in" and empty is not None:
            return f"host block {empty} holds nothing"
        return None

    def swap_out(self, kv: PagedKVCache, pairs: Sequence[Sequence[int]]) -> None:
        """Device block d -> host block h, every layer, for each [d, h] (checked first)."""
        if not pairs:
            return
        self.reap()
        buf = self._buffer(len(pairs))
        try:
            with self._copies() as stage:
                for a in range(0, len(pairs), self.stage_blocks):
                    part = pairs[a:a + self.stage_blocks]
                    dev = to_device([p[0] for p in part], kv.device)
                    for i, store in enumerate((kv.k_store, kv.v_store)):
                        dst = buf[i, a:a + len(part)]
                        staged = dst if stage is None else stage[i, :len(part)]
                        torch.index_select(store.transpose(0, 1), 0, dev, out=staged)
                        if staged is not dst:
                            dst.copy_(staged, non_blocking=True)
        except BaseException:
            self._retire(buf)  # (given back once the copies queued into it have run)
            raise
        for i, p in enumerate(pairs):
            self.held[p[1]] = (buf, i)

    def swap_in(self, kv: PagedKVCache, pairs: Sequence[Sequence[int]]) -> None:
        """Host block h -> device block d, every layer, for each [d, h] (checked first); the
        host blocks are free then (their memory once the copies have run)."""
        if not pairs:
            return
        self.reap()
        with self._copies() as stage:
            for buf, runs in _runs(pairs, self.held, self.stage_blocks):
                for first, devs in runs:
                    dev = to_device(devs, kv.device)
                    for i, store in enumerate((kv.k_store, kv.v_store)):
                        src = buf[i, first:first + len(devs)]
                        if stage is not None:
                            src = stage[i, :len(devs)].copy_(src, non_blocking=True)
                        store.transpose(0, 1).index_copy_(0, dev, src)
        self.drop([p[1] for p in pairs])

    def drop(self, hosts: Sequence[int]) -> None:
        """The host blocks are free; a buffer none of them holds any more is given back (on a
        GPU once the copies queued so far have run)."""
        gone = {}
        for h in hosts:
            entry = self.held.pop(h, None)
            if entry is not None:
                gone[entry[0].data_ptr()] = entry[0]
        still = {b.data_ptr() for b, _ in self.held.values()}
        for ptr, buf in gone.items():
            if ptr not in still:
                self._retire(buf)
        self.reap()  # (a buffer whose copies ran long ago goes at once)

    def close(self) -> None:
        """Every buffer given back (the shard is closing): waits for the copies."""
        self.drop(list(self.held))
        if self.stream is not None:
            self.stream.synchronize()
        self.reap()

    # ---- memory and streams -------------------------------------------------------------------
    def _buffer(self, n: int) -> torch.Tensor:
        """Host memory for n blocks (K and V), page-locked on a GPU machine. It is mapped
        pages of its own (an anonymous mmap, unmapped when the tensor goes): two buffers from
        the heap could share a page, and the driver refuses to register a page twice."""
        dtype = self.kv.k_store.dtype
        nbytes = n * self.block_bytes
        raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        buf = raw.view(dtype).view(2, n, *self.block_shape)
        if self.stream is not None:
            err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
            if err != 0:  # (copies from pageable memory still work, only slower)
                _clear_cuda_error()
                log.warning("host KV pool: cudaHostRegister of %d MB failed (CUDA error %d): "
                            "the copies run from pageable memory", nbytes >> 20, err)
            else:
                self.registered.add(buf.data_ptr())
        return buf

    def _retire(self, buf: torch.Tensor) -> None:
        if self.stream is None:
            return  # (plain memory: freed with its last reference)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.retiring.append((buf, done))

    def reap(self) -> None:
        """Give back the retiring buffers whose copies have run (the shard calls it between
        steps while any retire)."""
        keep = []
        for buf, done in self.retiring:
            if not done.query():
                keep.append((buf, done))
            elif buf.data_ptr() in self.registered:
                self.registered.discard(buf.data_ptr())
                if int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())) != 0:
                    _clear_cuda_error()
        self.retiring = keep

    @contextmanager
    def _copies(self) -> Iterator[torch.Tensor | None]:
        """Copies queued inside run on the copy stream after every kernel queued so far on the
        device's current stream, and every kernel queued there later waits for them (on the
        GPU: the host goes on), also when one of them raises. Yields the device staging
        buffer (made at the first swap), or None on the CPU, where the copies simply run."""
        if self.stream is None:
            yield None
            return
        if self.stage is None:
            self.stage = torch.empty((2, self.stage_blocks, *self.block_shape),
                                     dtype=self.kv.k_store.dtype, device=self.kv.device)
        compute = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(compute)
        try:
            with torch.cuda.stream(self.stream):
                yield self.stage
        finally:
            compute.wait_stream(self.stream)


def _runs(pairs: Sequence[Sequence[int]], held: dict[int, tuple[torch.Tensor, int]],
          most: int) -> Iterator[tuple[torch.Tensor, list[tuple[int, list[int]]]]]:
    """The pairs' host blocks as runs of consecutive indexes of one buffer (each at most
    `most` long): (buffer, [(first index, the device blocks of the run), ...]), so each run is
    one contiguous copy."""
    by_buf: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
    for d, h in pairs:
        buf, i = held[h]
        by_buf.setdefault(buf.data_ptr(), (buf, []))[1].append((i, d))
    for buf, items in by_buf.values():
        items.sort()
        runs: list[tuple[int, list[int]]] = []
        for i, d in items:
            if runs and runs[-1][0] + len(runs[-1][1]) == i and len(runs[-1][1]) < most:
                runs[-1][1].append(d)
            else:
                runs.append((i, [d]))
        yield buf, runs


def _clear_cuda_error() -> None:
    """Clear the CUDA runtime's last error after a failed register or unregister: torch's
    binding returns the code but leaves the error set, and the next kernel launch's check would
    raise it. Through the process's own libcudart (torch loaded it: the same instance)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except OSError:
            continue
    log.debug("host KV pool: no libcudart found to clear the last error with")
