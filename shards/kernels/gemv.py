"""One-row projections of a dense layer's decode step as Triton GEMV kernels, with the work
around them folded in, so that a layer is 6 kernels instead of 9.

At batch 1 each projection reads its whole weight once for one row: cuBLAS's GEMV does that
near the memory's bandwidth, but the elementwise kernels between the projections (the residual
adds with their RMSNorms, SiLU * up) are each a launch and a drain of the GPU: ~2-4 us a kernel
inside a CUDA graph, ~0.1 ms a token on a 30-layer model. Here:

- `gemv(x, w, norm=(nw, eps))`: the input's RMSNorm as the GEMV's prologue (every program
  computes the row's scale itself: the row is a few KB, read from L2);
- `gemv(..., gate_up=True)`: the fused gate/up weight's two halves in one program each block of
  rows, SiLU(g) * u as the epilogue;
- `gemv(..., residual=r)`: the residual add as the epilogue.

So the step is: q/k/v (norm prologue), decode attention and its merge, o_proj (+ residual),
gate/up (norm prologue, SiLU * up), down (+ residual); the next layer's q/k/v normalizes its own
input. Roundings follow eager torch as `row_ops` does (the norm rounded before its weight
multiplies it, the projection's output rounded before the residual add and before SiLU);
only the order of the float32 sums differs from cuBLAS's.

Launch shapes (`config`) were measured on an H200 (`bench/gemv_sweep.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels import GEMV_ROWS_MAX
from layersplit.shards.kernels.gemv_operands import checked_out
from layersplit.shards.kernels.pdl import pdl, pdl_start
from layersplit.shards.kernels.route_row import route_row
from layersplit.shards.switches import switched_off


@triton.jit
def _chunk(P, offs_k, K, EVEN_K: tl.constexpr):
    """Values offs_k of a vector of K as float32 (masked where K is not whole blocks)."""
    if EVEN_K:
        v = tl.load(P + offs_k)
    else:
        v = tl.load(P + offs_k, mask=offs_k < K, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _gemv(X, NW, W, B, R, Y, N, K, UP, eps,
          NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, SILU: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
          FLOAT32: tl.constexpr = False, NORM_OUT=None, WRITE_NORMED: tl.constexpr = False,
          FLOAT_PRODUCT: tl.constexpr = False, ONE_PASS: tl.constexpr = False,
          ROUTE: tl.constexpr = False, COUNTER=None, RW=None, RIDS=None,
          R_E: tl.constexpr = 1, R_EPOW2: tl.constexpr = 1, R_K: tl.constexpr = 1,
          R_KPOW2: tl.constexpr = 1, R_NORM: tl.constexpr = False,
          R_SOFTMAX_TOP: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # (Y may be wider: the rounded result is stored in it; FLOAT32: float32 weights, the sums
    # kept as they are, as F.linear(x.float(), w) gives them)
    xdt = X.dtype.element_ty  # (the row's: the norm rounds in it)
    dt = tl.float32 if FLOAT32 else xdt
    if NORM and not ONE_PASS:  # the row's RMSNorm scale, as `fused.rms_norm` (float32 mean
        # of squares), before the weights' first loads
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = _chunk(X, k0 + tl.arange(0, BLOCK_K), K, EVEN_K)
            sq += xs * xs
        scale = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if ONE_PASS:  # (the squares summed in the weights' loop, the scale applied to the sums)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    rows = W + offs_n[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = _chunk(X, offs_k, K, EVEN_K)
        if ONE_PASS:  # w * x unscaled and unrounded; the scale multiplies the sums below
            sq += x * x
            x = _chunk(NW, offs_k, K, EVEN_K) * x
        elif NORM:  # w * bf16(x * scale), rounded: `fused.rms_norm`
            nw = _chunk(NW, offs_k, K, EVEN_K)
            if FLOAT_PRODUCT:  # (a float32 weight times the float32 normed row, rounded once)
                x = (nw * (x * scale)).to(xdt).to(tl.float32)
            else:
                x = (nw * (x * scale).to(xdt).to(tl.float32)).to(xdt).to(tl.float32)
            if WRITE_NORMED:  # (program 0 keeps the normed row for the next kernel)
                if pid == 0:
                    tl.store(NORM_OUT + offs_k, x.to(xdt), mask=offs_k < K)
        if EVEN_K:
            m = mask_n[:, None]
        else:
            m = mask_n[:, None] & (offs_k < K)[None, :]
        w = tl.load(rows + offs_k[None, :], mask=m, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if SILU:  # the up half: rows N + offs_n of the fused weight
            wu = tl.load(rows + UP + offs_k[None, :], mask=m, other=0.0)
            acc_u += wu.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if ONE_PASS:
        scale = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        y = y * scale
    if HAS_B:  # before the one rounding: the correctly rounded sum (as cuBLAS on most shapes)
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = y.to(dt)
    if SILU:  # F.silu(g) * u, each rounded as torch's ops
        g = y.to(tl.float32)
        u = tl.sum(acc_u, axis=1)
        if ONE_PASS:
            u = u * scale
        u = u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (s * u).to(dt)
    if HAS_R:  # h + F.linear(...): the projection rounded, then the sum
        r = tl.load(R + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dt)
    tl.store(Y + offs_n, y, mask=mask_n)
    if ROUTE:  # (`gemv_route`) the last program to finish routes the row over every logit
        tl.debug_barrier()  # (every warp's stores issued before the release below)
        done = tl.atomic_add(COUNTER, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            route_row(Y, RW, RIDS, 0, R_E, R_EPOW2, R_K, R_KPOW2, R_NORM, R_SOFTMAX_TOP,
                      FRESH=True)
            tl.store(COUNTER, 0)  # (ready for the next launch: a graph's replay)


@triton.jit
def _gemm_rows(X, s_x, NW, W, B, R, s_r, Y, s_y, M, N, K, UP, eps,
               NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
               SILU: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT_PRODUCT: tl.constexpr = False,
               PDL: tl.constexpr = False):
    """`_gemv` for a few rows (2 .. BLOCK_M) through the tensor cores (`tl.dot`): program
    (block of N, block of rows); the same prologue and epilogues, row by row."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dt = X.dtype.element_ty
    xrows = X + offs_m[:, None].to(tl.int64) * s_x
    if NORM:  # each row's RMSNorm scale
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(xrows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :],
                         other=0.0).to(tl.float32)
            sq += xs * xs
        scale = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    cols = W + offs_n[None, :].to(tl.int64) * K  # (BLOCK_K, BLOCK_N) tiles of W's transpose
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(xrows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if NORM:
            nw = tl.load(NW + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            if FLOAT_PRODUCT:
                x = (nw[None, :] * (x.to(tl.float32) * scale[:, None])).to(dt)
            else:
                x = (nw[None, :] * (x.to(tl.float32) * scale[:, None]).to(dt).to(tl.float32)
                     ).to(dt)
        m = mask_k[:, None] & mask_n[None, :]
        w = tl.load(cols + offs_k[:, None], mask=m, other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        if SILU:
            wu = tl.load(cols + UP + offs_k[:, None], mask=m, other=0.0)
            if IEEE:
                acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(x, wu, acc_u)
    y = acc
    if HAS_B:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y.to(dt)
    if SILU:
        g = y.to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (sg * u).to(dt)
    out = mask_m[:, None] & mask_n[None, :]
    if HAS_R:
        r = tl.load(R + offs_m[:, None].to(tl.int64) * s_r + offs_n[None, :], mask=out,
                    other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dt)
    tl.store(Y + offs_m[:, None].to(tl.int64) * s_y + offs_n[None, :], y, mask=out)


MAX_ROWS = GEMV_ROWS_MAX  # the most rows `gemv` takes (a verify tree, a batch)


def route_counter(device: torch.device | str) -> torch.Tensor:
    """A `gemv_route` call site's counter of finished programs: one int32 zero, kept by the
    caller (a layer) and reused by every launch there (the routing program sets it back)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def gemv_route(x: torch.Tensor, w: torch.Tensor, counter: torch.Tensor, top_k: int,
               renorm: bool, *, norm: tuple[torch.Tensor, float] | None = None,
               norm_out: torch.Tensor | None = None, weights_dtype: torch.dtype | None = None,
               softmax_top: bool = False, cfg: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router's GEMV of one row `x` (1, K) by `w` (E, K) (with `norm` and `norm_out` as
    `gemv`'s) and the routing of its logits in the same launch: (weights (1, top_k) float32 or
    `weights_dtype`, expert ids (1, top_k) int64), equal to `gemv` then `moe_gemv.moe_route`
    (`softmax_top`: `moe_route_softmax_top`) on the logits rounded to x's dtype. The last of
    the GEMV's programs to finish (counted in `counter`, `route_counter`'s, which no other
    launch may use at the same time) routes the row: one launch fewer a MoE layer's step."""
    n = w.shape[0]
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv_route: one row (1, K), got {tuple(x.shape)}")
    if counter.shape != (1,) or counter.dtype != torch.int32 or counter.device != x.device:
        raise ValueError(f"gemv_route: counter {tuple(counter.shape)} {counter.dtype} on "
                         f"{counter.device} is not `route_counter`'s int32 (1,) on {x.device}")
    if not 1 <= top_k <= n:
        raise ValueError(f"gemv_route: top_k={top_k} of {n} experts")
    rw = torch.empty(1, top_k, dtype=weights_dtype or torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    gemv(x, w, norm=norm, norm_out=norm_out, cfg=cfg, route={
        "ROUTE": True, "COUNTER": counter, "RW": rw, "RIDS": ids, "R_E": n,
        "R_EPOW2": triton.next_power_of_2(n), "R_K": top_k,
        "R_KPOW2": triton.next_power_of_2(top_k), "R_NORM": renorm,
        "R_SOFTMAX_TOP": softmax_top})
    return rw, ids


def rows_config(m: int, k: int, *, norm: bool = False, gate_up: bool = False,
                head: bool = False) -> dict:
    """The launch shape of `_gemm_rows` for m rows, from `bench/gemv_sweep.py --rows 8/16/32`
    on an H200 at the default model's shape (k = 576, 1536): tiles of the rows (rounded up to a
    power of two, at least 16) by 16 outputs, blocks of K of 128; the head's 64 outputs by
    blocks of 64 (17.7-21.2 us at 8-32 rows against cuBLAS's 36.6-42.0). Tiles of 64 rows and
    wider K were not measured."""
    block_k = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
    out = {"BLOCK_M": max(16, triton.next_power_of_2(m)), "BLOCK_N": 16, "BLOCK_K": block_k,
           "num_warps": 8 if norm and not gate_up else 4}  # (q/k/v with its norm: 8)
    if head:
        out.update(BLOCK_N=64, BLOCK_K=min(block_k, 64), num_warps=4)
    elif gate_up and m <= 16:
        out["BLOCK_N"] = 32
    return out


# a one-row GEMV of fewer outputs than this reads its rows in wide blocks: `bench/gemv_sweep.py
# --weight-float32 --plain router64=64x2048 --plain router128=128x4096` (H200, 2026-11-30): a
# float32 router 4.50 -> 1.46 us (DeepSeek-V2-Lite's), 8.20 -> 2.25 (GLM-4.5-Air's); bf16 128 x
# 2048 2.08 -> 1.55, 576 x 2048 2.39 -> 2.14; 2048 x 2048 keeps blocks of 256 (3.46 against 3.70)
FEW_OUTPUTS = 1024

# a normed projection of 4096+ outputs from a row of 1025..2048 (Qwen3-30B-A3B's q/k/v, 5120 x
# 2048) in blocks of 8 rows: `bench/gemv_sweep.py --plain qkv=5120x2048:norm` (H200, 2026-12-01)
# 8.64 -> 7.52 us; the model's batch 1 372.1 against 361.1 tok/s, 1.030 x (bench/RESULTS.md,
# MoE). Measured on that model only (the rule also takes Qwen3-1.7B's 4096 x 2048 q/k/v).
# `LAYERSPLIT_GEMV_NORM_WIDE=0`: blocks of 2 rows, as before
NORM_WIDE_SWITCH = "LAYERSPLIT_GEMV_NORM_WIDE"


def config(k: int, *, norm: bool = False, gate_up: bool = False, head: bool = False,
           n: int | None = None) -> dict:
    """The launch shape for a weight of k inputs, from `bench/gemv_sweep.py` on an H200 at
    the default model's and the Llama-8B shapes (k = 576 .. 12288): few rows a program (one or
    two weight rows) and one or two warps fill the GPU with small programs, which keeps the
    most loads in flight; a row of up to 1024 is one block (masked), and with the norm's
    prologue wide blocks amortise it. `n`: the outputs; fewer than FEW_OUTPUTS of rows of whole
    blocks of 1024 (a MoE router's, a latent projection's) read in blocks of 1024 by 8 warps;
    with the norm, 4096+ outputs from 1025..2048 inputs in blocks of 8 rows (NORM_WIDE_SWITCH)."""
    whole = triton.next_power_of_2(k)
    if gate_up:  # (a gate row and an up row a program)
        return {"BLOCK_N": 1, "BLOCK_K": whole if k <= 1024 else 512,
                "num_warps": 1 if k <= 1024 else 4}
    if head:
        return {"BLOCK_N": 4, "BLOCK_K": 128 if k <= 1024 else 256, "num_warps": 1}
    if k <= 1024:
        return {"BLOCK_N": 2, "BLOCK_K": whole, "num_warps": 4}
    if norm:
        if k <= 2048 and n is not None and n >= 4096 and not switched_off(NORM_WIDE_SWITCH):
            return {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}
        return {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4}
    if n is not None and n < FEW_OUTPUTS and k % 1024 == 0:  # (too few programs of a row each
        # to keep loads in flight: fewer, wider blocks; measured on whole blocks only)
        return {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 8}
    return {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1}


def gemv(x: torch.Tensor, w: torch.Tensor, *, bias: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
         gate_up: bool = False, out_dtype: torch.dtype | None = None, head: bool = False,
         cfg: dict | None = None, norm_out: torch.Tensor | None = None,
         float_product: bool = False, one_pass: bool = False,
         route: dict | None = None) -> torch.Tensor:
    """F.linear of rows `x` (M, K), M <= MAX_ROWS, by `w` (N, K), with `norm` = (weight, eps):
    each row's RMSNorm first; `gate_up`: w is the fused (2F, K) gate/up weight and the result
    SiLU(g) * u (M, F); `residual` (M, N): added to the result. Returns a new (M, N or F)
    tensor, rounded to x's dtype and stored as `out_dtype` (default x's). `head`: the weight is
    a vocabulary's (its launch shape); `cfg`: a launch shape other than `config`'s (one row)
    or `rows_config`'s (more). One row runs `_gemv`, more `_gemm_rows` (tensor cores).
    A float32 weight of a 16-bit row (a router's), with `out_dtype` float32, gives the float32
    sums unrounded (`F.linear(x.float(), w)`, without the row's copy); one row only.
    `norm_out` (1, K) of x's dtype, with `norm` and one row: the normed row is written there
    too (a router's GEMV handing its normed input to the experts' kernels). `float_product`:
    `norm`'s weight is float32 and multiplies the float32 normed row before its one rounding
    (gpt-oss's `FloatProductRMSNorm`; a zero-centred norm's 1 + w, `fused_hybrid.zc_norm`).
    `one_pass` (one row, with `norm`, no `norm_out`): the row's squares summed in the weights'
    loop, not in a pass of its own before it, and the scale applied to the sums: the weight
    times the unscaled row in float32, never rounded (`ONE_PASS_SWITCH`'s comment says why).
    `route`: `gemv_route`'s routing arguments of the one-row kernel (its own to pass)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"gemv: x must be 1 to {MAX_ROWS} rows (M, K) of contiguous values, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    rows = x.shape[0]
    n, k = w.shape
    wide = w.dtype == torch.float32 != x.dtype and out_dtype == torch.float32 and rows == 1 \
        and norm is None and not gate_up and residual is None
    if x.shape[1] != k or w.stride() != (k, 1) or (w.dtype != x.dtype and not wide):
        raise ValueError(f"gemv: weight {tuple(w.shape)} {w.dtype} (strides {w.stride()}) does "
                         f"not take a row of {x.shape[1]} {x.dtype} (contiguous rows)")
    if gate_up:
        if n % 2 or bias is not None:
            raise ValueError(f"gemv: a gate/up weight has an even row count and no bias, got "
                             f"{n} rows{' and a bias' if bias is not None else ''}")
        n //= 2
    y = checked_out("gemv", x, n, k, bias, residual, norm, None, out_dtype)
    eps = 0.0 if norm is None else float(norm[1])
    nw = x if norm is None else norm[0]
    b = x if bias is None else bias
    r = x if residual is None else residual
    up = n * k  # the up half's offset in the gate/up weight (a Python int: int64 past 2**31)
    if float_product and (norm is None or norm[0].dtype != torch.float32):
        raise ValueError("gemv: float_product takes a norm of a float32 weight, got "
                         f"{'none' if norm is None else norm[0].dtype}")
    flags = {"NORM": norm is not None, "HAS_B": bias is not None,
             "HAS_R": residual is not None, "SILU": gate_up, "FLOAT_PRODUCT": float_product}
    if norm_out is not None and (norm is None or rows != 1 or norm_out.shape != x.shape or
                                 norm_out.dtype != x.dtype or not norm_out.is_contiguous()):
        raise ValueError(f"gemv: norm_out {tuple(norm_out.shape)} {norm_out.dtype} takes the "
                         f"normed row of one row {tuple(x.shape)} {x.dtype} with a norm")
    if one_pass and (norm is None or rows != 1 or norm_out is not None):
        raise ValueError("gemv: one_pass takes one row with a norm and no norm_out, got "
                         f"{rows} row(s), {'a' if norm is not None else 'no'} norm"
                         f"{', norm_out' if norm_out is not None else ''}")
    if rows == 1:
        c = dict(cfg or config(k, norm=norm is not None, gate_up=gate_up, head=head, n=n))
        block_n, block_k = c.pop("BLOCK_N"), c.pop("BLOCK_K")
        _gemv[(triton.cdiv(n, block_n),)](
            x, nw, w, b, r, y, n, k, up, eps, **flags, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, FLOAT32=wide,
            NORM_OUT=x if norm_out is None else norm_out, WRITE_NORMED=norm_out is not None,
            ONE_PASS=one_pass, **(route or {}), **c, **pdl(x))
        return y
    if route is not None:
        raise ValueError(f"gemv: route takes one row, got {rows}")
    c = dict(cfg or rows_config(rows, k, norm=norm is not None, gate_up=gate_up,
                                head=head))
    block_m, block_n, block_k = c.pop("BLOCK_M"), c.pop("BLOCK_N"), c.pop("BLOCK_K")
    if min(block_m, block_n, block_k) < 16:  # (tl.dot's least tile)
        raise ValueError(f"gemv: a few-rows launch shape needs blocks of at least 16, got "
                         f"{block_m} x {block_n} x {block_k}")
    _gemm_rows[(triton.cdiv(n, block_n), triton.cdiv(rows, block_m))](
        x, x.stride(0), nw, w, b, r, r.stride(0), y, y.stride(0), rows, n, k, up, eps, **flags,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **c,
        **pdl(x))
    return y
