"""Where a chunked prefill's time goes, in one process (no IPC): a long prompt prefilled in
chunks of each given size, wall time next to the GPU's busy time, and the torch profiler's
kernel table of the smallest chunk size (what chunking adds over one piece).

    python bench/profile_prefill.py --model random:qwen3-8b --tokens 32768 --chunks 2048,32768
    python bench/profile_prefill.py --model random:qwen3.5-27b --tokens 8192 --chunks 8192 --hf
    python bench/profile_prefill.py --model random:smollm2-135m-shape --tokens 3900 \
        --chunks 512,2048,3900 --prefill-kernels off,on --launch-costs --no-profile

Loads the whole model on one GPU the way a shard does (fused projections, a paged KV pool).
With `--hf`, then (ours freed first: the 27B shape does not fit twice) transformers' own
model of the same config, one forward of the whole prompt, timed and profiled the same way:
the two kernel tables side by side say where a gap to transformers lies.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards import fused  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

BLOCK = 16
ROWS = 30  # kernel table rows printed


def profiled(label: str, fn) -> None:
    """One call of `fn` (returning its wall seconds) under the torch profiler: the kernel table
    by GPU time, then wall next to the GPU's busy time."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = fn()
    ka = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ka) / 1e6
    print(ka.table(sort_by="self_device_time_total", row_limit=ROWS))
    print(f"{label} under the profiler: wall {wall:.3f} s, GPU busy {gpu:.3f} s", flush=True)


def hf_forward(args, ids: torch.Tensor) -> None:
    """transformers' model of the same config (its own random init), one forward of `ids`:
    median of `--repeats` after a warm-up, then profiled."""
    import transformers

    from bench.decode import _timed, hf_model_of_config

    hf, _ = hf_model_of_config(args.model, "cuda:0", torch.bfloat16)
    x = ids[None]

    def once() -> float:
        with torch.inference_mode():
            return _timed(lambda: hf(x, logits_to_keep=1), "cuda:0")

    once()
    runs = [once() for _ in range(args.repeats)]
    print(f"transformers {transformers.__version__}, one piece: {statistics.median(runs):.3f} s "
          "(runs " + ", ".join(f"{r:.3f}" for r in runs) + ")", flush=True)
    profiled("transformers, one piece", once)


def launch_costs(model) -> None:
    """Host microseconds per call (median of 5 batches of 500, the device never waited on) of
    what an eager layer launches: torch's RMSNorm module against the row kernels."""
    from layersplit.shards.kernels import row_ops
    from layersplit.shards.layers.rotary import apply_rope

    layer = model.layers[0]
    a = layer.self_attn
    h = torch.randn(8, model.cfg.hidden_size, device="cuda:0", dtype=torch.bfloat16)
    w = layer.input_layernorm.weight
    nh, ng, d = a.num_heads, a.num_kv_heads, a.head_dim
    qkv = torch.randn(8, (nh + 2 * ng) * d, device="cuda:0", dtype=torch.bfloat16)
    cos = sin = torch.ones(8, d, device="cuda:0", dtype=torch.bfloat16)
    q = qkv[:, :nh * d].view(8, nh, d)
    costs = {
        "torch RMSNorm module": lambda: layer.input_layernorm(h),
        "torch add": lambda: h + h,
        "torch apply_rope (one of q, k)": lambda: apply_rope(q, cos, sin),
        "row_ops.rms_norm_rows": lambda: row_ops.rms_norm_rows(h, w, 1e-5),
        "row_ops.add_rms_norm": lambda: row_ops.add_rms_norm(h, h, w, 1e-5),
        "row_ops.rope_qk": lambda: row_ops.rope_qk(qkv, cos, sin, nh, ng),
        "row_ops.silu_mul": lambda: row_ops.silu_mul(qkv[:, :2 * d]),
    }
    for name, fn in costs.items():
        fn()
        batches = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            batches.append((time.perf_counter() - t0) / 500 * 1e6)
        torch.cuda.synchronize()
        print(f"host cost: {name}: {statistics.median(batches):.1f} us a call", flush=True)


def prefill(ex: RangeExecutor, ids: torch.Tensor, chunk: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a in range(0, ids.shape[0], chunk):
        ex.run(ids[a:a + chunk], a)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunks", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-kernels", default="auto",
                    help="comma list of auto, on, off: each a pass of every chunk size, eager "
                         "steps through the row kernels by the default threshold, always, never")
    ap.add_argument("--launch-costs", action="store_true",
                    help="first, the host's cost of each call an eager layer makes")
    ap.add_argument("--no-profile", action="store_true", help="no kernel table at the end")
    ap.add_argument("--hf", action="store_true",
                    help="then transformers' model of the same config, one piece")
    args = ap.parse_args()
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    model = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16, "cuda:0")
    fuse_projections(model, compile=True)
    blocks = -(-args.tokens // BLOCK)
    ex = RangeExecutor(model, blocks * BLOCK, device="cuda:0", paged=(blocks, BLOCK))
    ex.kv.set_table(0, 0, list(range(blocks)))
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), device="cuda:0")
    if args.launch_costs:
        launch_costs(model)
    chunks = sorted(int(c) for c in args.chunks.split(","))
    default_min = fused.PREFILL_KERNELS_MIN_ELEMENTS
    for mode in args.prefill_kernels.split(","):
        fused.PREFILL_KERNELS_MIN_ELEMENTS = {"on": 0, "off": 1 << 62}.get(mode, default_min)
        for c in chunks:
            prefill(ex, ids, c)  # warm-up
            runs = [prefill(ex, ids, c) for _ in range(args.repeats)]
            print(f"kernels {mode}: chunk {c}: {statistics.median(runs):.4f} s (runs "
                  + ", ".join(f"{r:.4f}" for r in runs) + ")", flush=True)
    fused.PREFILL_KERNELS_MIN_ELEMENTS = default_min
    if not args.no_profile:
        profiled(f"chunk {chunks[0]}", lambda: prefill(ex, ids, chunks[0]))
    if args.hf:
        del ex, model
        gc.collect()
        torch.cuda.empty_cache()
        hf_forward(args, ids)


if __name__ == "__main__":
    main()
