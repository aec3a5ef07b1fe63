"""Launch shapes of the one-row GEMV kernels (`shards.kernels.gemv`) against cuBLAS, per
projection and for a whole layer's projections with the work between them, at a model's shape.

Each time is 20 replays of a CUDA graph of calls that cycle through enough copies of the
weights (>= 256 MB) that the L2 cache holds none of them, as in a model's step; no launch
overhead. "layer chain": o_proj, the residual add with its norm, gate/up, SiLU * up, down, the
residual add with the next layer's norm and its q/k/v (today's decode step after attention,
cuBLAS and `row_ops`), against the four GEMV kernels that fold that work in; cycling through
the model's layer count of weights. `--rows M` (M > 1): the same for M rows (a verify tree, a
small batch), the few-rows kernel (`_gemm_rows`) against cuBLAS's GEMM.

    python bench/gemv_sweep.py --model smollm2-135m-shape [--model llama-8b-shape] \
        [--block-n 1,2,4,8] [--warps 1,2,4,8] [--stages 0] [--ops qkv,o,gate_up,down,head] \
        [--rows 1]
    python bench/gemv_sweep.py --plain in_proj=3648x2048 --plain o_proj=2048x2048
    python bench/gemv_sweep.py --weight-float32 --plain router=64x2048
    python bench/gemv_sweep.py --model qwen3.5-27b --ops gate_up --zc \
        --plain in_proj=16480x5120:norm

`--zc`: the hybrid step's variants (`fused_hybrid.HybridFast._gemv_step`): the norm prologue's
weight a float32 1 + w (`float_product`), and gate/up with that norm as its prologue too;
`--one-pass`: the norms' squares summed in the weights' loop (`gemv`'s `one_pass`).

`--plain NAME=NxK[:norm]`: a plain projection of N outputs and K inputs (no residual or SiLU;
`:norm`, the input's RMSNorm as its prologue):
the `GemvLinear` projections of the layers `shards.fused` does not fuse (above: DeepSeek-V2-
Lite's query and latent projection, its o_proj), swept as the ops above, without a chain.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from layersplit.shards.fused import rms_norm  # noqa: E402
from layersplit.shards.kernels import gemv as gk  # noqa: E402
from layersplit.shards.kernels import row_ops  # noqa: E402

from bench.moe_kernel_sweep import time_us  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def candidates(k: int, ns, ws, stages):
    """Launch shapes to try: blocks of K that divide it (the largest four), and below 1024 a
    last block partly masked (the whole row in one block included)."""
    ks = [b for b in (64, 128, 256, 512, 1024, 2048) if k % b == 0][-4:]
    if k < 1024:
        ks = sorted(set(ks) | {128, 256, triton.next_power_of_2(k)})
    for bn, bk, nw, st in itertools.product(ns, ks, ws, stages):
        if bn * bk <= 16384:
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw}
            if st:
                cfg["num_stages"] = st
            yield cfg


def row_candidates(m: int, k: int):
    """Launch shapes of the few-rows kernel (`_gemm_rows`) for m rows."""
    bm = max(16, triton.next_power_of_2(m))
    for bn, bk, nw in itertools.product((16, 32, 64), (64, 128), (4, 8)):
        if bk <= max(16, triton.next_power_of_2(k)):
            yield {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw}


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def norm_kw(k: int, args, dev: str, dt: torch.dtype) -> dict:
    """`gemv`'s arguments of a norm prologue over k inputs (`--zc`: a float32 1 + w)."""
    nw = torch.rand(k, device=dev) + 0.5
    got = {"norm": (nw, 1e-6), "float_product": True} if args.zc else \
        {"norm": (nw.to(dt), 1e-5)}
    if args.one_pass:  # (the squares summed in the weights' loop: `gemv`'s `one_pass`)
        got["one_pass"] = True
    return got


def sweep_plain(name: str, n: int, k: int, args, dev: str, dt: torch.dtype,
                norm: bool = False) -> dict:
    """One plain projection (N, K): cuBLAS, the GEMV's default launch shape and the sweep's
    best five, over enough copies of the weight that the L2 cache holds none."""
    m = args.rows
    x = torch.randn(m, k, device=dev).to(dt)
    wdt = torch.float32 if args.weight_float32 else dt  # (a router's: float32 logits out)
    size = torch.finfo(wdt).bits // 8
    kw = {"out_dtype": torch.float32} if args.weight_float32 else {}
    if norm:
        kw.update(norm_kw(k, args, dev, dt))
    copies = max(2, -(-(256 << 20) // (n * k * size)))
    ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(wdt) for _ in range(copies)]
    reps, mb = max(copies, 24), n * k * size / 1e6
    t_blas = time_us(lambda j: F.linear(x.to(wdt), ws[j]), reps, 20, copies)
    t_def = time_us(lambda j: gk.gemv(x, ws[j], **kw), reps, 20, copies)
    rows = []
    cands = candidates(k, ints(args.block_n), ints(args.warps), ints(args.stages)) \
        if m == 1 else row_candidates(m, k)
    for cfg in cands:
        try:
            rows.append((time_us(lambda j: gk.gemv(x, ws[j], cfg=cfg, **kw), reps, 20, copies),
                         cfg))
        except Exception as e:  # noqa: BLE001 - a launch shape the GPU refuses
            print(f"  {name} {cfg}: {type(e).__name__}")
    rows.sort(key=lambda r: r[0])
    default = gk.config(k, n=n, norm=norm) if m == 1 else gk.rows_config(m, k, norm=norm)
    print(f"{name} ({n}x{k}{', norm' if norm else ''}, {mb:.1f} MB): cuBLAS "
          f"{'(without the norm) ' if norm else ''}{t_blas:.2f} us "
          f"({mb / t_blas * 1e3:.0f} "
          f"GB/s); default {default} {t_def:.2f} us ({mb / t_def * 1e3:.0f} GB/s); best "
          + "; ".join(f"{t:.2f} us {c_}" for t, c_ in rows[:5]))
    return {"cublas_us": t_blas, "default_us": t_def, "best": rows[:5], "mb": mb}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--block-n", default="1,2,4,8")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--stages", default="0", help="num_stages values (0: Triton's default)")
    ap.add_argument("--ops", default="qkv,o,gate_up,down,head")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows a call (more than 1: the few-rows kernel, a verify tree's)")
    ap.add_argument("--plain", action="append", default=[],
                    help="NAME=NxK: a plain projection to sweep (no model's chain)")
    ap.add_argument("--weight-float32", action="store_true",
                    help="--plain weights in float32, the logits float32 (a MoE router's)")
    ap.add_argument("--zc", action="store_true",
                    help="the hybrid step's norms: float32 1 + w, and gate/up normed too")
    ap.add_argument("--one-pass", action="store_true",
                    help="the norm prologues summed in the weights' loop (gemv's one_pass)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.one_pass and args.rows != 1:
        ap.error("--one-pass takes one row (gemv's one_pass is one-row only)")
    if args.one_pass and args.model and not args.zc:
        ap.error("--one-pass takes --zc for --model's ops (their norms are --zc's then)")
    if args.weight_float32 and any(p.endswith(":norm") for p in args.plain):
        ap.error("--weight-float32 takes plain projections only (a router's, no norm)")
    if args.weight_float32 and args.rows != 1:
        ap.error("--weight-float32 takes one row (a router's float32 GEMV is one-row only)")
    dev, dt = "cuda:0", torch.bfloat16
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(0))
    report = {}
    for spec in args.plain:
        name, _, shape = spec.partition("=")
        shape, _, kind = shape.partition(":")
        if kind not in ("", "norm"):
            ap.error(f"--plain {spec}: the kind after ':' is norm or nothing")
        n, k = (int(v) for v in shape.lower().split("x"))
        report[f"plain/{name}"] = sweep_plain(name, n, k, args, dev, dt, kind == "norm")
    for name in args.model or ([] if args.plain else ["smollm2-135m-shape"]):
        c = json.loads((CONFIGS / name / "config.json").read_text())
        hd_, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        nh, ng = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim", hd_ // nh)
        ops = {"qkv": ((nh + 2 * ng) * d, hd_, "norm"), "o": (hd_, nh * d, "res"),
               "gate_up": (2 * f, hd_, "silu"), "down": (hd_, f, "res"),
               "head": (c["vocab_size"], hd_, "norm")}
        m = args.rows
        x = {k_: torch.randn(m, k_, device=dev).to(dt) for k_ in {hd_, nh * d, f}}
        nw_ = torch.rand(hd_, device=dev).to(dt) + 0.5
        res = torch.randn(m, hd_, device=dev).to(dt)
        best = {}
        for op, (n, k, kind) in ops.items():
            if op not in args.ops.split(","):
                continue
            copies = max(2, -(-(256 << 20) // (n * k * 2)))
            ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(dt) for _ in range(copies)]
            reps = max(copies, 24)
            mb = n * k * 2 / 1e6
            kw = {"norm": {"norm": (nw_, 1e-5)}, "res": {"residual": res},
                  "silu": {"gate_up": True}}[kind]
            if args.zc and kind in ("norm", "silu"):  # (the hybrid step's zero-centred norms)
                kw.update(norm_kw(k, args, dev, dt))
            t_blas = time_us(lambda j: F.linear(x[k], ws[j]), reps, 20, copies)
            rows = []
            if op == "head":  # the torch head: RMSNorm module, cuBLAS, the logits as float32
                t_blas = time_us(lambda j: F.linear(rms_norm(x[k], nw_, 1e-5), ws[j]).float(),
                                 reps, 20, copies)
            cands = candidates(k, ints(args.block_n), ints(args.warps), ints(args.stages)) \
                if m == 1 else row_candidates(m, k)
            for cfg in cands:
                try:
                    t = time_us(lambda j: gk.gemv(x[k], ws[j], cfg=cfg, **kw), reps, 20, copies)
                except Exception as e:  # noqa: BLE001 - a launch shape the GPU refuses
                    print(f"  {op} {cfg}: {type(e).__name__}")
                    continue
                rows.append((t, cfg))
            rows.sort(key=lambda r: r[0])
            kw["head"] = op == "head"
            t_def = time_us(lambda j: gk.gemv(x[k], ws[j], **kw), reps, 20, copies)
            if not rows:
                continue
            best[op] = rows[0][1]
            ref = "torch head" if op == "head" else "cuBLAS"
            default = gk.config(k, norm="norm" in kw, gate_up=kind == "silu",
                                head=op == "head", n=n) \
                if m == 1 else gk.rows_config(m, k, norm=kind == "norm", gate_up=kind == "silu",
                                              head=op == "head")
            print(f"{name} {op} ({n}x{k}, {mb:.1f} MB): {ref} {t_blas:.2f} us "
                  f"({mb / t_blas * 1e3:.0f} GB/s); default {default} {t_def:.2f} us; "
                  "best " + "; ".join(f"{t:.2f} us {c_}" for t, c_ in rows[:5]))
            report[f"{name}/{op}"] = {"cublas_us": t_blas, "default_us": t_def,
                                      "best": rows[:5], "mb": mb}
            ws = None  # (their memory back; the timed lambdas hold the name)
        # a layer's chain after attention, `layers` layers of weights
        w = [{op: (torch.randn(n, k, device=dev) * k ** -0.5).to(dt)
              for op, (n, k, _) in ops.items() if op != "head"} for _ in range(layers)]
        ln = [(torch.rand(hd_, device=dev).to(dt) + 0.5) for _ in range(2)]
        attn = torch.randn(m, nh * d, device=dev).to(dt)
        h0 = torch.randn(m, hd_, device=dev).to(dt)

        def old(j):
            h, xn = row_ops.add_rms_norm(h0, F.linear(attn, w[j]["o"]), ln[0], 1e-5)
            act = row_ops.silu_mul(F.linear(xn, w[j]["gate_up"]))
            out, nxt = row_ops.add_rms_norm(h, F.linear(act, w[j]["down"]), ln[1], 1e-5)
            return F.linear(nxt, w[j]["qkv"])

        def new(j, cfgs=None):
            cf = cfgs or {}
            h = gk.gemv(attn, w[j]["o"], residual=h0, cfg=cf.get("o"))
            act = gk.gemv(h, w[j]["gate_up"], norm=(ln[0], 1e-5), gate_up=True,
                          cfg=cf.get("gate_up"))
            out = gk.gemv(act, w[j]["down"], residual=h, cfg=cf.get("down"))
            return gk.gemv(out, w[j]["qkv"], norm=(ln[1], 1e-5), cfg=cf.get("qkv"))

        t_old = time_us(old, layers, 20, layers)
        t_new = time_us(new, layers, 20, layers)
        t_best = time_us(lambda j: new(j, best), layers, 20, layers)
        print(f"{name} layer chain (us a layer): cuBLAS + row kernels {t_old:.2f}; GEMV kernels "
              f"{t_new:.2f} (defaults), {t_best:.2f} (best of the sweep); "
              f"old/new {t_old / t_new:.3f}, old/best {t_old / t_best:.3f}")
        report[f"{name}/chain"] = {"old_us": t_old, "new_us": t_new, "best_us": t_best,
                                   "best": best}
        w = None  # (their memory back; `old` and `new` hold the name)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
