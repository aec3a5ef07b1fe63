"""Where a decode step's time goes, in one process (no IPC): GPU kernels vs wall time.

    python bench/profile_decode.py --model random:qwen3-8b --kv 768 [--no-compile] [--no-graphs]

Loads the whole model on one GPU the way a shard does (fused projections, CUDA graphs), times
decode steps with a synchronization after each, then prints the torch profiler's kernel table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--kv", type=int, default=768, help="context length at the profiled step")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    args = ap.parse_args()
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    model = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16, "cuda:0")
    fuse_projections(model, compile=not args.no_compile)
    ex = RangeExecutor(model, args.kv + args.steps + 8, device="cuda:0",
                       static_decode=not args.no_graphs)
    ex.run(torch.randint(0, 1000, (args.kv,)), 0)
    tok = torch.tensor([5])
    t0 = time.perf_counter()
    for i in range(3):
        ex.run(tok, args.kv + i)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        out = ex.run(tok, args.kv + 3)
        int(out.argmax())
        times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            int(ex.run(tok, args.kv + 3).argmax())
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka) / 10
    n_kernels = sum(e.count for e in ka if e.self_device_time_total > 0) / 10
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    print(f"{args.model}: compile={not args.no_compile} graphs={not args.no_graphs}; first steps "
          f"(compile/capture) {warm:.1f} s; step wall median {med * 1e3:.2f} ms "
          f"({1 / med:.1f} tok/s); GPU busy {gpu_us / 1e3:.2f} ms/step in ~{n_kernels:.0f} "
          "kernels")


if __name__ == "__main__":
    main()
