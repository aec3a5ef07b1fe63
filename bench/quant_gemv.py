"""The quantized GEMV (`shards.kernels.quant_gemv`) at the Llama-8B shape's projections, per GGUF
type and row count, against torch's matmul on the same weight dequantized to float16: time per
call (CUDA events, median of `--repeats`: with the launch's host time, as an eager step pays it),
and the device time alone (`graph us`: back-to-back calls replayed from a CUDA graph, as a
captured decode step runs them, over enough copies of the weight that it is read from HBM, not
L2), with the bandwidth it draws from the bytes it reads (the floor: those bytes / copy
bandwidth). The K types (Q4_K, Q5_K, Q6_K) are timed in the layout the runtime gives them on
a GPU, planar rows (`quant_blocks.to_planar`, 2-3 % more bytes than stored); `--layout stored`
times the stored blocks' kernel instead. `FP8` (not a GGUF type) is the FP8 checkpoints' layout,
float8 e4m3 values with a float32 scale per 128 x 128 block (`shards.kernels.fp8_gemv`), timed
also as the fused decode step runs gate/up (`gate_up*`: SiLU(gate) * up, half the outputs).
The planar K types are also timed as the fused decode step (`shards.fused`) launches them:
`qkv^` with the input norm as its prologue, `gate_up^` through `quant_linear.module_gemv` with
the norm (the GEMV over both halves, then SiLU * up as a kernel of its own:
`PLANAR_SILU_APART`), and `gate_up*` as one kernel with the SiLU epilogue, the norm too.
`INT4` is the GPTQ / AWQ checkpoints' kept layout (`int4.Int4Weight`: int32 words of eight
4-bit values along K, a uint8 zero and a float32 scale per row and group of 128 inputs,
`shards.kernels.int4_gemv`), random values, timed as FP8 is (gate_up* too); its GB/s count the
words, zeros and scales.

    python bench/quant_gemv.py --json /tmp/quant_gemv.json
    python bench/quant_gemv.py --sweep --types Q4_K,Q6_K --rows 1   # launch shapes, for tuning
    python bench/quant_gemv.py --sweep --types Q4_K,Q6_K --rows 1 --best   # ... each one's best
    python bench/quant_gemv.py --sweep --types FP8 --rows 1,4
    python bench/quant_gemv.py --sweep --types INT4 --rows 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from layersplit.shards.fp8 import dequantize_fp8, quantize_fp8
from layersplit.shards.fused import rms_norm
from layersplit.shards.int4 import dequantize_packed
from layersplit.shards.kernels.fp8_gemv import fp8_gemv
from layersplit.shards.kernels.int4_gemv import int4_gemv
from layersplit.shards.kernels.quant_gemv import dequantize, quant_gemv
from layersplit.shards.layers.quant_linear import QuantLinear, module_gemv
from layersplit.shards.quant_blocks import KEPT_TYPES, PLANAR_TYPES, random_blocks, to_planar
from triton.runtime.errors import OutOfResources

SWEEP = [{"BLOCK_N": b, "num_warps": w, "SB": sb} for b in (1, 2, 4, 8, 16) for w in (2, 4, 8)
         for sb in (1, 4)]
# (the planar K types: a chunk of BLOCK_K inputs is BLOCK_K / 32 groups, a row's 16-byte
# quant loads; 1K to 16K values a tile; STAGES 1, or 3: the loop's loads pipelined)
PLANAR_SWEEP = [{"BLOCK_N": b, "BLOCK_K": k, "num_warps": w, "STAGES": s}
                for b in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (2, 4, 8)
                for s in (1, 3) if 1024 <= b * k <= 16384]
FP8_SWEEP = [{"BLOCK_N": b, "BLOCK_K": k, "num_warps": w} for b in (4, 8, 16, 32)
             for k in (128, 256, 512) for w in (2, 4, 8)]
FP8_BLOCK = (128, 128)
# (a chunk of BLOCK_K inputs spans BLOCK_K / 128 groups: a row's 64 to 512 bytes of words; at
# most 16K values a tile, as FP8's widest)
INT4_SWEEP = [{"BLOCK_N": b, "BLOCK_K": k, "num_warps": w} for b in (4, 8, 16, 32)
              for k in (128, 256, 512, 1024) for w in (2, 4, 8) if b * k <= 16384]
INT4_GROUP = 128
SPREAD = 256 << 20  # bytes of weight copies a graph replay walks through (past the L2)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# the planar K types as the fused decode step launches them (see the module doc)
STEP_SHAPES = [("qkv^", SHAPES["qkv"]), ("gate_up^", SHAPES["gate_up"]),
               ("gate_up*", SHAPES["gate_up"])]
EPS = 1e-5


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


def _graph_time(calls: list, repeats: int) -> float:
    """Microseconds per call of `calls` (one per weight copy) captured once in a CUDA graph and
    replayed `repeats` times back to back: the device time without the host's launch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / (repeats * len(calls))


def _copies(t: torch.Tensor) -> list[torch.Tensor]:
    n = max(1, min(8, -(-SPREAD // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def _print_best(rows: list[dict]) -> None:
    """Each (type, projection, row count)'s fastest swept launch shape, beside its default's
    time (the row without a `cfg`)."""
    default = {(r["type"], r["proj"], r["rows"]): r["quant_graph_us"] for r in rows
               if "cfg" not in r}
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["type"], r["proj"], r["rows"])
        if "cfg" in r and (key not in best or r["quant_graph_us"] < best[key]["quant_graph_us"]):
            best[key] = r
    print(f"{'type':<5} {'proj':<8} {'rows':>4} {'default us':>10} {'best us':>8} {'GB/s':>6}  "
          f"best launch shape")
    for (t, proj, m), r in best.items():
        print(f"{t:<5} {proj:<8} {m:>4} {default.get((t, proj, m), float('nan')):>10.1f} "
              f"{r['quant_graph_us']:>8.1f} {r['quant_GBps']:>6.0f}  {r['cfg']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(KEPT_TYPES),
                    help="GGUF types, FP8 and INT4, comma-separated")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="time every launch shape of SWEEP as well (BLOCK_N x num_warps)")
    ap.add_argument("--best", action="store_true",
                    help="with --sweep: print each projection's fastest launch shape at the end")
    ap.add_argument("--layout", choices=("planar", "stored"), default="planar",
                    help="the K types' rows: planar (the runtime's on a GPU) or as stored")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda:0"
    rng = np.random.default_rng(0)
    out = []
    print(f"{'type':<5} {'proj':<8} {'rows':>4} {'quant us':>9} {'f16 us':>8} "
          f"{'graph us':>9} {'GB/s':>7} {'f16 graph us':>13}")
    for qtype in args.types.split(","):
        # (FP8 also as the fused decode step runs gate/up: SiLU(gate) * up, each program
        # reading its rows of both halves)
        planar = qtype in PLANAR_TYPES and args.layout == "planar"
        shapes = [*SHAPES.items()] + [("gate_up*", SHAPES["gate_up"])] * (qtype in
                                                                         ("FP8", "INT4"))
        for proj, (n, k) in shapes + STEP_SHAPES * planar:
            nw = (1 + 0.1 * torch.randn(k, device=dev)).half()  # (the step's input norm)
            if qtype == "FP8":
                blocks, scale = quantize_fp8(torch.randn(n, k, device=dev) * 0.02, FP8_BLOCK)
                w16 = dequantize_fp8(blocks, scale, FP8_BLOCK, torch.float16)
                nbytes = blocks.numel()

                def kernel(x, b, cfg=None, scale=scale, silu=proj == "gate_up*"):
                    return fp8_gemv(x, b, scale, FP8_BLOCK, cfg=cfg, gate_up=silu)
            elif qtype == "INT4":
                g = k // INT4_GROUP
                blocks = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32,
                                       device=dev)
                zeros = torch.randint(0, 16, (n, g), dtype=torch.uint8, device=dev)
                scales = (torch.rand(n, g, device=dev) * 0.004).half().float()
                w16 = dequantize_packed(blocks, zeros, scales, None, INT4_GROUP, torch.float16)
                nbytes = blocks.numel() * 4 + zeros.numel() + scales.numel() * 4

                def kernel(x, b, cfg=None, zeros=zeros, scales=scales, silu=proj == "gate_up*"):
                    return int4_gemv(x, b, zeros, scales, INT4_GROUP, cfg=cfg, gate_up=silu)
            else:
                blocks = torch.from_numpy(random_blocks(n, k, qtype, rng)).to(dev)
                if planar:
                    blocks = to_planar(blocks, qtype)
                w16 = dequantize(blocks, qtype, k, torch.float16, planar=planar)
                nbytes = blocks.numel()

                mods: dict[int, QuantLinear] = {}

                def kernel(x, b, cfg=None, qtype=qtype, planar=planar, proj=proj, nw=nw,
                           mods=mods, k=k):
                    norm = (nw, EPS) if proj.endswith(("^", "*")) else None
                    if proj == "gate_up^":  # (the step's route: `module_gemv`)
                        if b.data_ptr() not in mods:
                            mods[b.data_ptr()] = QuantLinear(b, qtype, k, planar=planar)
                        return module_gemv(x, mods[b.data_ptr()], norm=norm, gate_up=True)
                    return quant_gemv(x, b, qtype, cfg=cfg, planar=planar, norm=norm,
                                      gate_up=proj.startswith("gate_up") and norm is not None)
            copies, copies16 = _copies(blocks), _copies(w16)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.float16)
                normed = rms_norm(x, nw, EPS) if planar and proj.endswith(("^", "*")) else x
                want = F.linear(normed, w16).float()
                if proj in ("gate_up*", "gate_up^"):
                    g, u = want.chunk(2, dim=-1)
                    want = F.silu(g) * u
                err = (kernel(x, blocks).float() - want).abs().max().item()
                q_us = _time(lambda: kernel(x, blocks), args.repeats)
                f_us = _time(lambda: F.linear(x, w16), args.repeats)
                g_us = _graph_time([lambda b=b: kernel(x, b) for b in copies], args.repeats)
                fg_us = _graph_time([lambda w=w: F.linear(x, w) for w in copies16], args.repeats)
                gbps = nbytes / g_us / 1e3
                out.append({"type": qtype, "layout": "planar" if planar else "stored",
                            "proj": proj, "n": n, "k": k, "rows": m,
                            "quant_us": q_us, "f16_us": f_us, "quant_graph_us": g_us,
                            "quant_GBps": gbps, "f16_graph_us": fg_us,
                            "block_bytes": nbytes, "max_abs_err_vs_f16": err})
                print(f"{qtype:<5} {proj:<8} {m:>4} {q_us:>9.1f} {f_us:>8.1f} {g_us:>9.1f} "
                      f"{gbps:>7.0f} {fg_us:>13.1f}  (max |err| vs f16 {err:.3g})")
                sweep = FP8_SWEEP if qtype == "FP8" else INT4_SWEEP if qtype == "INT4" else \
                    PLANAR_SWEEP if planar else SWEEP
                for cfg in sweep if args.sweep and (proj in SHAPES or not planar) else []:
                    try:
                        us = _graph_time([lambda b=b, c=cfg: kernel(x, b, cfg=c)
                                          for b in copies], args.repeats)
                    except OutOfResources as e:  # (a shape the device cannot hold: said)
                        print(f"      {str(cfg):<50} not run: {e}")
                        continue
                    out.append({"type": qtype, "proj": proj, "rows": m, "cfg": cfg,
                                "quant_graph_us": us, "quant_GBps": nbytes / us / 1e3})
                    print(f"      {str(cfg):<50} {us:>9.1f} {nbytes / us / 1e3:>7.0f}")
    if args.best:
        _print_best(out)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(0), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
