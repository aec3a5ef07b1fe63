"""Host cost of the small torch calls on a shard's decode path: median µs of each (GPU only).

A decode or verify step on a GPU is a graph replay plus a handful of these; each one the host
makes before the replay is time the GPU idles. Run: `python3 bench/host_costs.py [--device
cuda:0]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], n: int = 2000, sync: bool = False) -> float:
    """Median host time of `fn()` (after a warm-up); `sync`: the device idle before each."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def graph_of(kernels: int, a: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            a.add_(1)
    return g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    dev = torch.device(p.parse_args().device)
    torch.cuda.set_device(dev)
    x = torch.arange(32, dtype=torch.long)  # a verify step's token ids, on the host
    buf = torch.zeros(32, dtype=torch.long, device=dev)
    pinned = torch.zeros(32, dtype=torch.long, pin_memory=True)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    anc, anc2 = (torch.full((32, 32), v, dtype=torch.bool, device=dev) for v in (False, True))
    kv = torch.zeros(15, 4, 2048, 3, 64, dtype=torch.bfloat16, device=dev)  # a shard's K
    src, dst = torch.tensor([5, 6, 7, 8], device=dev), torch.tensor([1, 2, 3, 4], device=dev)

    def move() -> None:
        kv[:, 0, dst] = kv[:, 0, src]

    a = torch.zeros(576, device=dev)
    big, small = graph_of(400, a), graph_of(10, a)
    calls: list[tuple[str, Callable[[], object], bool]] = [
        ("pin_memory()", x.pin_memory, False),
        ("pin_memory().to(dev, non_blocking)", lambda: x.pin_memory().to(dev, non_blocking=True),
         False),
        ("x.to(dev, non_blocking), pageable", lambda: x.to(dev, non_blocking=True), False),
        ("buf.copy_(x, non_blocking), pageable", lambda: buf.copy_(x, non_blocking=True), False),
        ("buf.copy_(pinned, non_blocking)", lambda: buf.copy_(pinned, non_blocking=True), False),
        ("pinned.copy_(x)", lambda: pinned.copy_(x), False),
        ("device to device copy_", lambda: buf.copy_(pos.expand(32)), False),
        ("pos.fill_(7)", lambda: pos.fill_(7), False),
        ("anc.copy_(anc2)", lambda: anc.copy_(anc2), False),
        ("torch.tensor(list)", lambda: torch.tensor([1, 2, 3, 4], dtype=torch.long), False),
        ("x.min(); x.max()", lambda: (int(x.min()), int(x.max())), False),
        ("torch.aminmax(x)", lambda: torch.aminmax(x), False),
        ("x.tolist()", x.tolist, False),
        ("event record", lambda: torch.cuda.Event().record(), False),
        ("kv[:, 0, dst] = kv[:, 0, src]", move, False),
        ("graph of 400 kernels: replay", big.replay, True),
        ("graph of 10 kernels: replay", small.replay, True),
    ]
    for name, fn, sync in calls:
        print(f"{name:40s} {median_us(fn, 500 if sync else 2000, sync):7.1f} µs")


if __name__ == "__main__":
    main()
