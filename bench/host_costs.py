"""Host cost of the small torch calls on a shard's decode path: median µs of each (GPU only).

A decode or verify step on a GPU is a graph replay plus a handful of these; each one the host
makes before the replay is time the GPU idles. Run: `python3 bench/host_costs.py [--device
cuda:0]`. `--kernels`: the eager launches an eager prefill step makes (our Triton row kernels,
with programmatic dependent launch on and off, a one-argument Triton kernel, torch's linear),
5 rows of the default model's widths: the host time of a few-row prefill step is mostly these.
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


def kernel_calls(dev: torch.device) -> list[tuple[str, Callable[[], object], bool | None]]:
    """The eager launches of a few-row prefill step (see the module), each PDL off, then on
    (a row whose `sync` is None switches the mode: run, not timed)."""
    import os

    import triton
    import triton.language as tl
    from layersplit.shards.kernels import PDL_SWITCH
    from layersplit.shards.kernels.gemv import gemv
    from layersplit.shards.kernels.row_ops import add_rms_norm, rope_qk, silu_mul

    @triton.jit
    def _touch(X):
        tl.store(X, 1.0)

    n, d, f, nh, ng, hd = 5, 576, 1536, 9, 3, 64
    bf = torch.bfloat16
    h, x = (torch.randn(n, d, device=dev, dtype=bf) for _ in range(2))
    w = torch.ones(d, device=dev, dtype=bf)
    gu = torch.randn(n, 2 * f, device=dev, dtype=bf)
    qkv = torch.randn(n, (nh + 2 * ng) * hd, device=dev, dtype=bf)
    cos, sin = (torch.randn(n, hd, device=dev, dtype=bf) for _ in range(2))
    w_qkv = torch.randn((nh + 2 * ng) * hd, d, device=dev, dtype=bf)
    one = torch.zeros(1, device=dev)

    out: list[tuple[str, Callable[[], object], bool | None]] = [
        ("triton: a one-argument kernel", lambda: _touch[(1,)](one), False),
        ("torch: linear, 5 rows", lambda: torch.nn.functional.linear(x, w_qkv[:d]), False),
        ("torch: empty_like", lambda: torch.empty_like(h), False),
    ]
    for on in (False, True):
        tag = "PDL" if on else "plain"

        def switch(on: bool = on) -> None:  # (timed before each mode's calls: `main`)
            os.environ[PDL_SWITCH] = "1" if on else "0"

        out += [
            (f"(PDL {'on' if on else 'off'})", switch, None),
            (f"add_rms_norm ({tag})", lambda: add_rms_norm(h, x, w, 1e-5), False),
            (f"silu_mul ({tag})", lambda: silu_mul(gu), False),
            (f"rope_qk ({tag})", lambda: rope_qk(qkv, cos, sin, nh, ng), False),
            (f"gemv 1 row ({tag})", lambda: gemv(x[:1], w_qkv), False),
        ]
    return out


def profile_calls(fn: Callable[[], object], n: int = 2000, top: int = 14) -> None:
    """Print where `n` calls of `fn` spend their host time: the functions with the most time
    of their own, µs a call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, func), (_, calls, own, cum, _) in rows:
        where = f"{file.rsplit('/', 2)[-2:][-1]}:{line} {func}"
        print(f"    {own / n * 1e6:7.2f} own {cum / n * 1e6:7.2f} cum µs  "
              f"{calls / n:5.1f}x  {where[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--kernels", action="store_true", help="only the eager kernel launches")
    p.add_argument("--profile", action="store_true",
                   help="with --kernels: where each launch's host time goes (cProfile over "
                        "2,000 calls, the functions that take most of it)")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    if args.kernels:
        import os

        from layersplit.shards.kernels import PDL_SWITCH
        saved = os.environ.get(PDL_SWITCH)
        try:
            for name, fn, sync in kernel_calls(dev):
                if sync is None:  # (a mode's switch: set, not timed)
                    fn()
                    continue
                print(f"{name:40s} {median_us(fn, 2000, sync):7.1f} µs")
                if args.profile:
                    profile_calls(fn)
        finally:
            if saved is None:
                os.environ.pop(PDL_SWITCH, None)
            else:
                os.environ[PDL_SWITCH] = saved
        return
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
