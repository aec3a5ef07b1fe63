"""Launch settings of the decode-attention kernel (`shards.kernels.decode_attention`) at long
contexts: microseconds per layer call and the K/V bandwidth they reach, one decode row (batch 1).

    python bench/decode_attention_sweep.py [--keys 8192,32768,131072] [--paged 16] [--rows 1]
        [--per-sm 1,2,4,8] [--block-n 64,128,auto] [--warps 4,8] [--stages default,4]

`--rows n`: a step of n rows of one sequence (a verify chain); `--block-n auto`: `block_n`'s
choice.
Each setting is timed as replays of a CUDA graph of one call per layer over distinct caches
(so the keys come from HBM, not L2), the median of 5 replays (`attention_kernel.time_graph`);
the output is compared with the first setting's. `--paged B`: the cache is a block pool of
B-row blocks, each sequence's table a random permutation (the server's layout); 0: one
contiguous slot.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.kernels import decode_attention as da  # noqa: E402
from layersplit.shards.layers.step import StepInfo  # noqa: E402

from bench.attention_kernel import time_graph  # noqa: E402

SHAPES = {  # name: heads, kv heads, head dim, q/k norm
    "smollm2-135m": (9, 3, 64, False),
    "qwen3-8b": (32, 8, 128, True),
    "qwen3-30b-a3b": (32, 4, 128, True),  # 4 KV heads: past 4K keys, more than 32 splits
}
BYTES_PER_SHAPE = 6e9  # caches per shape and key count (layers are added until this)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-8b")
    ap.add_argument("--keys", default="8192,32768,131072")
    ap.add_argument("--paged", type=int, default=16, help="rows per block; 0: contiguous")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--max-block-m", default="32", help="query rows per tile, comma-separated")
    ap.add_argument("--per-sm", default="1,2,4,8")
    ap.add_argument("--block-n", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="default,4")
    args = ap.parse_args()
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    auto_block = da.block_n
    grid = list(itertools.product(
        [int(x) for x in args.max_block_m.split(",")],
        [int(x) for x in args.per_sm.split(",")],
        [None if x == "auto" else int(x) for x in args.block_n.split(",")],
        [int(x) for x in args.warps.split(",")],
        [None if x == "default" else int(x) for x in args.stages.split(",")]))
    n = args.rows
    print(f"{torch.cuda.get_device_name(0)}, paged {args.paged}, {n} rows")
    print(f"{'shape':<13} {'keys':>7} {'per_sm':>6} {'blk_n':>5} {'warps':>5} {'stages':>6} "
          f"{'splits':>6} {'us/layer':>9} {'GB/s':>7}  max|diff|  (block_m)")
    for name in args.shapes.split(","):
        h, g, d, qk_norm = SHAPES[name]
        for t in [int(k) for k in args.keys.split(",")]:
            torch.manual_seed(0)
            per_layer = 2 * t * g * d * 2
            layers = max(1, min(32, int(BYTES_PER_SHAPE // per_layer)))
            kb = args.paged
            if kb:
                nb = -(-(t + 1) // kb) + 1
                kc = torch.randn(layers, nb, kb, g, d, device=dev, dtype=dt)
                tables = torch.randperm(nb, device=dev)[None, :nb - 1].contiguous()
            else:
                kc = torch.randn(layers, 1, t + 1, g, d, device=dev, dtype=dt)
                tables = None
            vc = torch.randn_like(kc)
            qkv = torch.randn(n, (h + 2 * g) * d, device=dev, dtype=dt)
            qn = kn = torch.ones(d, device=dev, dtype=dt) if qk_norm else None
            pos = torch.tensor([t - n], device=dev)
            step = StepInfo.static(pos, n, t)
            ang = (t - n + torch.arange(n, device=dev)[:, None]) * (
                1 / 1e4 ** (torch.arange(0, d, 2, device=dev).float() / d))
            emb = torch.cat([ang, ang], dim=-1)
            cos, sin = emb.cos().to(dt), emb.sin().to(dt)
            ref = None
            for max_m, per_sm, block_n, warps, stages in grid:
                da.MAX_BLOCK_M = max_m
                block_m = min(max_m, max(16, 1 << (n * h // g - 1).bit_length()))
                da.LAUNCH.update(per_sm=per_sm, num_warps=warps, num_stages=stages)
                da.block_n = auto_block if block_n is None else (lambda d, m, b=block_n: b)
                out = {}

                def run(out=out, qkv=qkv, cos=cos, sin=sin, kc=kc, vc=vc, step=step, h=h,
                        qn=qn, kn=kn, tables=tables, layers=layers):
                    for i in range(layers):
                        out["o"] = da.decode_attention(qkv, cos, sin, kc[i], vc[i],
                                                       step.positions, 0, step.mask, 1, h, qn,
                                                       kn, 1e-6, None, tables)
                try:
                    with torch.inference_mode():
                        ms = time_graph(run, reps=5) / layers
                except Exception as e:  # a setting Triton cannot compile (shared memory)
                    print(f"{name:<13} {t:>7} {per_sm:>6} {block_n or 'auto':>5} {warps:>5} "
                          f"{stages or '-':>6}  failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                tiles = -(-n * h // g // block_m)  # (query tiles: programs of their own)
                splits, _ = da.key_split(t, g * tiles, dev, None, da.block_n(d, 2))
                diff = 0.0 if ref is None else float((out["o"].float() - ref).abs().max())
                if ref is None:
                    ref = out["o"].float()
                print(f"{name:<13} {t:>7} {per_sm:>6} {block_n or 'auto':>5} {warps:>5} "
                      f"{stages or '-':>6} {splits:>6} {ms * 1e3:>9.1f} "
                      f"{per_layer / ms / 1e6:>7.0f}  {diff:.3g}  ({block_m})", flush=True)
            del kc, vc
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
