"""Where a decode step's time goes, in one process (no IPC): GPU kernels vs wall time.

    python bench/profile_decode.py --model random:qwen3-8b --kv 768 [--no-compile] [--no-graphs]
    python bench/profile_decode.py --model random:qwen3.5-27b --kv 512 --batch 8
    python bench/profile_decode.py --model /tmp/llama8b-q4km.gguf --weight-format quantized \
        --profile-steps 32 --json /tmp/prof_q4km.json

Loads the whole model on one GPU the way a shard does (fused projections, CUDA graphs, a paged
KV pool of 16-token blocks, `--contiguous`: one slot of rows instead;
`--weight-format quantized`: a GGUF's blocks kept, as `weight_format = quantized`; `--batch
B`: B sequences in B slots, each step their batched decode step, one graph), times
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
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences a step (B > 1: the batched decode step of B slots, one "
                         "graph; its wall time a step of B tokens)")
    ap.add_argument("--device", default="cuda:0",
                    help="cpu: a smoke run of the script itself (no graphs, no kernels)")
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
    cuda = args.device.startswith("cuda")
    if args.batch < 1 or args.batch > 1 and (args.no_graphs or args.contiguous):
        ap.error("--batch takes 1 or more, and more than 1 its graphs over a paged pool")
    model = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16 if cuda else torch.float32,
                             args.device, weights=args.weight_format)
    fuse_projections(model, compile=not args.no_compile and cuda)
    load_s = time.perf_counter() - t0
    b = args.batch
    max_len = args.kv + args.steps + 8
    blocks = -(-max_len // BLOCK)
    ex = RangeExecutor(model, max_len, b, device=args.device,
                       static_decode=not args.no_graphs and (cuda or b > 1),
                       paged=None if args.contiguous else (b * blocks, BLOCK))
    for slot in range(b):  # (each sequence its own blocks and its own prompt)
        if not args.contiguous:
            ex.kv.set_table(slot, 0, list(range(slot * blocks, (slot + 1) * blocks)))
        ex.run(torch.randint(0, min(1000, cfg.vocab_size), (args.kv,)), 0, slot)
    tok = torch.tensor([5] * b)
    slots = list(range(b))

    def decode_step(pos: int) -> None:
        """One decode step, its tokens drawn (the worker's greedy draw, a sync)."""
        out = ex.run(tok, pos) if b == 1 else ex.static.run_batch(tok, slots, [pos] * b)
        greedy_draw(out.reshape(b, -1))[1].tolist()

    t0 = time.perf_counter()
    for i in range(3):
        decode_step(args.kv + i)
    if cuda:
        torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        decode_step(args.kv + 3)
        times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                 ) as prof:
        for _ in range(args.profile_steps):
            decode_step(args.kv + 3)
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
    print(f"{args.model} ({args.weight_format}): compile={not args.no_compile and cuda} "
          f"graphs={not args.no_graphs}; load {load_s:.1f} s; first steps (compile/capture) "
          f"{warm:.1f} s; step wall median {med * 1e3:.3f} ms ({b / med:.1f} tok/s, "
          f"{b} sequence(s)); per step "
          f"{step['kernels']:.0f} kernels, GPU busy {step['busy_us'] / 1e3:.3f} ms (kernels "
          f"summed {step['summed_us'] / 1e3:.3f}), host gap {gap / 1e3:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "weight_format": args.weight_format, "kv": args.kv,
             "paged": not args.contiguous,
             "graphs": not args.no_graphs, "batch": b,
             "device": torch.cuda.get_device_name(0) if cuda else args.device,
             "step_wall_ms": med * 1e3, "tok_s": b / med, "gap_ms": gap / 1e3,
             "load_s": load_s, **step}, indent=1))


if __name__ == "__main__":
    main()
