"""Launch shapes of the MoE GEMV kernels (`shards.kernels.moe_gemv`) against the grouped GEMM
(`routed_moe.grouped_experts`) at Qwen3-30B-A3B's expert shape: microseconds per layer call,
each timed as 100 replays of a CUDA graph of 24 calls that cycle through 12 layers' experts
(so the L2 cache holds none of them, as in a model's step; no launch overhead), bf16.

    python bench/moe_kernel_sweep.py [--rows 1,4,8] [--parts gate_up,down]
        [--experts 64 --hidden 2048 --width 1408 --top-k 8]   (DeepSeek-V2-Lite's experts, its
        6 routed and 2 shared chunks as 8)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.kernels import moe_gemv as mg  # noqa: E402
from layersplit.shards.layers import routed_moe  # noqa: E402

LAYERS = 12


def time_us(fn, reps: int = 24, replays: int = 100, copies: int = LAYERS) -> float:
    """Microseconds per call: `fn(j)` for j = 0..copies-1 in turn (each layer's weights),
    `reps` calls captured in a CUDA graph, replayed `replays` times."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn(r % copies)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--parts", default="gate_up,down")
    args = ap.parse_args()
    parts = args.parts.split(",")
    dev, dt = "cuda:0", torch.bfloat16
    e, h, i, k = args.experts, args.hidden, args.width, args.top_k
    gate_up = [(torch.randn(e, 2 * i, h, device=dev) * h ** -0.5).to(dt) for _ in range(LAYERS)]
    down = [(torch.randn(e, h, i, device=dev) * i ** -0.5).to(dt) for _ in range(LAYERS)]
    router = torch.randn(e, h, device=dev).to(dt)
    print(f"{torch.cuda.get_device_name(0)}: E={e} H={h} I={i} k={k}")
    for n in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(n, h, device=dev).to(dt)
        w, idx = routed_moe.route(x, router, k, True, False)
        bytes_read = len(set(idx.flatten().tolist())) * 3 * h * i * 2
        routed_moe.GEMV_TOKENS = 0
        grouped = time_us(lambda j: routed_moe.grouped_experts(x, w, idx, gate_up[j], down[j]))
        print(f"rows {n}: grouped GEMM {grouped:.1f} us ({bytes_read / grouped / 1e3:.0f} GB/s)")
        best = {}
        if "gate_up" in parts:
            for bi, bk, nw in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048),
                                                (1, 2, 4, 8)):
                cfg = {"BLOCK_I": bi, "BLOCK_K": bk, "num_warps": nw}
                if bk > 2 * h or bi * bk < 32 * nw * 8:  # (past the row; threads idle)
                    continue
                t = time_us(lambda j: mg.run_gemv(x, w, idx, gate_up[j], down[j],
                                                  gate_up_cfg=cfg))
                best.setdefault("gate_up", []).append((t, cfg))
        if "down" in parts:
            for bo, bk, nw in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024, 2048),
                                                (2, 4, 8)):
                cfg = {"BLOCK_O": bo, "BLOCK_K": bk, "num_warps": nw}
                if bk > 2 * i or bo * bk < 32 * nw * 8:
                    continue
                t = time_us(lambda j: mg.run_gemv(x, w, idx, gate_up[j], down[j], down_cfg=cfg))
                best.setdefault("down", []).append((t, cfg))
        for part, rows in best.items():
            rows.sort(key=lambda r: r[0])
            print(f"  {part}: " + "; ".join(f"{t:.1f} us {c}" for t, c in rows[:4]))
        t = time_us(lambda j: mg.run_gemv(x, w, idx, gate_up[j], down[j]))
        print(f"  default shapes: {t:.1f} us ({bytes_read / t / 1e3:.0f} GB/s)")
        if len(best) == 2:
            t = time_us(lambda j: mg.run_gemv(x, w, idx, gate_up[j], down[j],
                                              best["gate_up"][0][1], best["down"][0][1]))
            print(f"  best of both: {t:.1f} us ({bytes_read / t / 1e3:.0f} GB/s)")


if __name__ == "__main__":
    main()
