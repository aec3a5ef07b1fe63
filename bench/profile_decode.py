"""Where a decode step's time goes, in one process (no IPC): GPU kernels vs wall time.

    python bench/profile_decode.py --model random:qwen3-8b --kv 768 [--no-compile] [--no-graphs]
    python bench/profile_decode.py --model /tmp/llama8b-q4km.gguf --weight-format quantized \
        --profile-steps 32 --json /tmp/prof_q4km.json

Loads the whole model on one GPU the way a shard does (fused projections, CUDA graphs, a paged
KV pool of 16-token blocks, `--contiguous`: one slot of rows instead;
`--weight-format quantized`: a GGUF's blocks kept, as `weight_format = quantized`), times
`--steps` decode steps with a synchronization after each (their median is the step's wall
time), then records `--profile-steps` more under the torch profiler and prints, per step: the
kernels launched, the GPU's busy time (the union of the kernels' intervals), the host gap (the
wall time less the busy time: launches, the host's work, the sync) and the costliest kernels
(`bench/kernel_summary.py` reads the trace). Kernels replayed from a CUDA graph are counted one
by one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor  # noqa: E402
from layersplit.shards.finite import greedy_draw  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_summary import per_step, summarize  # noqa: E402

BLOCK = 16  # tokens per block of the paged pool (a shard's default `kv_block`)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--weight-format", default="dequantize", choices=["dequantize", "quantized"])
    ap.add_argument("--kv", type=int, default=768, help="context length at the profiled step")
    ap.add_argument("--steps", type=int, default=50, help="timed steps (the wall median)")
    ap.add_argument("--profile-steps", type=int, default=10, help="steps under the profiler")
    ap.add_argument("--top", type=int, default=15, help="kernels listed")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--by-grid", action="store_true",
                    help="a kernel's launches apart by grid and block (each width its own row)")
    ap.add_argument("--contiguous", action="store_true",
                    help="a contiguous KV slot instead of a shard's paged pool")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the first N layers of a configs/models preset (random:NAME)")
    args = ap.parse_args()
    model_name = args.model
    if args.layers:  # (GLM-4.5-Air's 211 GB do not fit one GPU)
        from moe import preset_shape
        cut = Path(tempfile.mkdtemp())
        model_name = preset_shape(args.model.removeprefix("random:"), args.layers, cut)
    ckpt = open_checkpoint(model_name)
    cfg = ckpt.config
    t0 = time.perf_counter()
    model = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16, "cuda:0",
                             weights=args.weight_format)
    fuse_projections(model, compile=not args.no_compile)
    load_s = time.perf_counter() - t0
    max_len = args.kv + args.steps + 8
    blocks = -(-max_len // BLOCK)
    ex = RangeExecutor(model, max_len, device="cuda:0", static_decode=not args.no_graphs,
                       paged=None if args.contiguous else (blocks, BLOCK))
    if not args.contiguous:
        ex.kv.set_table(0, 0, list(range(blocks)))
    ex.run(torch.randint(0, 1000, (args.kv,)), 0)
    tok = torch.tensor([5])
    t0 = time.perf_counter()
    for i in range(3):
        ex.run(tok, args.kv + i)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        out = ex.run(tok, args.kv + 3)
        int(greedy_draw(out.reshape(1, -1))[1])  # (the worker's greedy draw)
        times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            int(greedy_draw(ex.run(tok, args.kv + 3).reshape(1, -1))[1])
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        got = summarize(trace, args.top, args.by_grid)
    step = per_step(got, args.profile_steps)
    print("| kernel | per step | us per step | us a launch |\n|---|---:|---:|---:|")
    for t in step["top"]:
        print(f"| `{t['name']}` | {t['per_step']:.1f} | {t['us_per_step']:.1f} | "
              f"{t['us_per_step'] / max(t['per_step'], 1e-9):.2f} |")
    gap = med * 1e6 - step["busy_us"]
    print(f"{args.model} ({args.weight_format}): compile={not args.no_compile} "
          f"graphs={not args.no_graphs}; load {load_s:.1f} s; first steps (compile/capture) "
          f"{warm:.1f} s; step wall median {med * 1e3:.3f} ms ({1 / med:.1f} tok/s); per step "
          f"{step['kernels']:.0f} kernels, GPU busy {step['busy_us'] / 1e3:.3f} ms (kernels "
          f"summed {step['summed_us'] / 1e3:.3f}), host gap {gap / 1e3:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "weight_format": args.weight_format, "kv": args.kv,
             "paged": not args.contiguous,
             "graphs": not args.no_graphs, "device": torch.cuda.get_device_name(0),
             "step_wall_ms": med * 1e3, "tok_s": 1 / med, "gap_ms": gap / 1e3,
             "load_s": load_s, **step}, indent=1))


if __name__ == "__main__":
    main()
