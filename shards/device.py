"""A server process's compute setup: the device it computes on and its CPU threads."""

from __future__ import annotations

import torch
from layersplit.shards import compile_cache


def use_device(device: str, threads: int | None) -> torch.device:
    """Make `device` this process's current device (and cap torch's threads), and point its
    compilers at the compile cache of its key (`shards.compile_cache.use`; before anything
    compiles)."""
    dev = torch.device(device)
    if threads:
        torch.set_num_threads(threads)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    compile_cache.use(device)
    return dev


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor on `device`, without waiting for the device.

    `torch.tensor(values, device=cuda)` copies from pageable memory and then synchronizes the
    current stream: on the decode path that stalls the host until every kernel queued before it
    has run (on a shard, until the upstream shard's step has landed). Through pinned memory the
    copy is queued like a kernel; torch's pinned allocator keeps the buffer until it has run."""
    return host_to_device(torch.tensor(values, dtype=torch.long), device)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, through pinned memory on CUDA (see `to_device`): the
    copy is queued, the host does not wait for the stream."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
