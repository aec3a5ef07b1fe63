"""The quantized GEMV (`shards.kernels.quant_gemv`) at the Llama-8B shape's projections, per GGUF
type and row count, against torch's matmul on the same weight dequantized to float16: time per
call (CUDA events, median of `--repeats`), and the bandwidth the kernel draws from the blocks'
bytes (the floor: blocks / copy bandwidth).

    python bench/quant_gemv.py --json /tmp/quant_gemv.json
    python bench/quant_gemv.py --sweep --types Q4_K,Q6_K --rows 1   # launch shapes, for tuning
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from layersplit.shards.kernels.quant_gemv import dequantize, quant_gemv
from layersplit.shards.quant_blocks import KEPT_TYPES, random_blocks

SWEEP = [{"BLOCK_N": b, "num_warps": w} for b in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _time(f, repeats: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(KEPT_TYPES))
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="time every launch shape of SWEEP as well (BLOCK_N x num_warps)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda:0"
    rng = np.random.default_rng(0)
    out = []
    print(f"{'type':<5} {'proj':<8} {'rows':>4} {'quant us':>9} {'GB/s':>7} {'f16 us':>8}")
    for qtype in args.types.split(","):
        for proj, (n, k) in SHAPES.items():
            blocks = torch.from_numpy(random_blocks(n, k, qtype, rng)).to(dev)
            w16 = dequantize(blocks, qtype, k, torch.float16)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.float16)
                q_us = _time(lambda: quant_gemv(x, blocks, qtype), args.repeats)
                f_us = _time(lambda: F.linear(x, w16), args.repeats)
                gbps = blocks.numel() / q_us / 1e3
                out.append({"type": qtype, "proj": proj, "n": n, "k": k, "rows": m,
                            "quant_us": q_us, "quant_GBps": gbps, "f16_us": f_us,
                            "block_bytes": blocks.numel()})
                print(f"{qtype:<5} {proj:<8} {m:>4} {q_us:>9.1f} {gbps:>7.0f} {f_us:>8.1f}")
                for cfg in SWEEP if args.sweep else []:
                    us = _time(lambda: quant_gemv(x, blocks, qtype, cfg=cfg), args.repeats)
                    out.append({"type": qtype, "proj": proj, "rows": m, "cfg": cfg,
                                "quant_us": us, "quant_GBps": blocks.numel() / us / 1e3})
                    print(f"      {str(cfg):<40} {us:>9.1f} {blocks.numel() / us / 1e3:>7.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(0), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
