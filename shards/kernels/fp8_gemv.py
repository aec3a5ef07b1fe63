"""A Triton GEMV over weights kept in FP8 (`layers.fp8_linear`: float8 e4m3 values, a float32
scale per block of `block` rows x columns, `shards.fp8`), for steps of a few rows, with
`kernels.gemv`'s norm prologue and residual / SiLU * up epilogues (the fused decode step of
`shards.fused`).

Program (block of BLOCK_N outputs, row m): BLOCK_N divides the scale block's rows, so the
program's rows share one row of scales, and the scales multiply the activations, not the weight
(sum_k w[n, k] s[k // cols] x[k]): each chunk of BLOCK_K activations times the scales of its
columns (any BLOCK_K, one scale block or several), then the weight's chunk converted to float32
and multiplied by it in registers; float32 sums, rounded as `kernels.gemv._gemv` rounds them. A
few-row step runs it once per row (the grid's second axis): the weight's bytes come from DRAM once
and from L2 for the other rows. The weight is never rounded to the run dtype (as a dequantized-at-
load weight is): the products are of the float32 values, within float32's rounding of the
dequantize-then-matmul result (`tests/gpu/test_fp8_gemv.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.gemv_operands import check_launch, check_rows, checked_out
from layersplit.shards.kernels.pdl import pdl, pdl_start
from layersplit.shards.kernels.quant_planar import activations, epilogue, rms_scale

MAX_ROWS = 16  # the most rows `fp8_gemv` takes; more: `layers.fp8_linear.fp8_matmul`


def launch_config(n: int, k: int, gate_up: bool = False) -> dict:
    """The launch shape for `n` outputs of `k` inputs (`gate_up`: the fused SiLU * up step, `n`
    its outputs, half the weight's rows), the best of `bench/quant_gemv.py --sweep --types FP8`
    at the Llama-8B widths (block 128, 1 row, CUDA-graph replays; bench/RESULTS.md Q7, H200,
    2026-11-29): q/k/v and o 4 rows and chunks of 512 on 2 warps (10.3, 9.3 us), down (long
    inputs) the same on 4 warps (27.3 us), gate/up (wide outputs) 8 rows of 256 on 2 warps
    (36.3 us), the fused SiLU * up step 32 rows of 128 on 4 warps (40.0 us; noisy: 47-49 us at
    the next shapes)."""
    if gate_up:
        return {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4}
    if k >= 8192:
        return {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4}
    if n >= 16384:
        return {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2}
    return {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 2}


@triton.jit
def _fp8_gemv(X, s_x, NW, W, S, s_cols, B, R, s_r, Y, s_y, N, K, eps, BN, BK,
              NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
              SILU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr = False):
    pdl_start(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    dt = X.dtype.element_ty
    xrow = X + m * s_x
    scale = 1.0
    if NORM:  # the row's RMSNorm scale, as `kernels.gemv._gemv`
        scale = rms_scale(xrow, K, eps, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = acc
    w_rows = W + rows[:, None] * K
    s_row = S + (n0 // BN).to(tl.int64) * s_cols  # (the program's one row of scales)
    s_row_u = S + ((n0 + N) // BN).to(tl.int64) * s_cols  # (the up half's: rows N + offs_n)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = activations(xrow, NW, offs_k, mask_k, scale, NORM, dt)
        m2 = mask_n[:, None] & mask_k[None, :]
        s = tl.load(s_row + offs_k // BK, mask=mask_k, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += w * (x * s)[None, :]
        if SILU:
            su = tl.load(s_row_u + offs_k // BK, mask=mask_k, other=0.0)
            wu = tl.load(W + (rows + N)[:, None] * K + offs_k[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            acc_u += wu * (x * su)[None, :]
    y = tl.sum(acc, axis=1)
    y_u = y
    if SILU:
        y_u = tl.sum(acc_u, axis=1)
    epilogue(y, y_u, B, R, s_r, Y, s_y, m, offs_n, mask_n, dt, HAS_B, HAS_R, SILU)


def _rows_per_program(block_n: int, rows: int) -> int:
    """`block_n`, halved until it divides a scale block's `rows` (the program's rows then share
    one row of scales): 1 at the least, where both are positive (else ValueError)."""
    if block_n < 1 or rows < 1:
        raise ValueError(f"fp8_gemv: {block_n} rows a program over scale blocks of {rows} rows")
    while rows % block_n:
        block_n //= 2
    return block_n


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int], bias: torch.Tensor | None = None, *,
             norm: tuple[torch.Tensor, float] | None = None,
             residual: torch.Tensor | None = None, gate_up: bool = False,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             cfg: dict | None = None) -> torch.Tensor:
    """F.linear of rows `x` (M, K), M <= MAX_ROWS, by the (N, K) FP8 `weight` and its float32
    block `scale`, summed in float32 and rounded to x's dtype, with `kernels.gemv.gemv`'s
    options: `norm` = (weight, eps); `gate_up`, the weight is the fused gate/up one (2F rows,
    F a whole number of scale blocks) and the result SiLU(g) * u (M, F); `residual` (M, N)
    added. Stored as `out_dtype` (default x's), or into `out` (M, N or F; rows may be strided).
    `cfg`: a launch shape (BLOCK_N, BLOCK_K, num_warps; powers of two) other than
    `launch_config`'s."""
    check_rows("fp8_gemv", x, MAX_ROWS)
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"fp8_gemv: scale blocks of {block} (rows, columns) are not positive")
    want = (-(-n // bn), -(-k // bk))
    if weight.dtype != torch.float8_e4m3fn or weight.shape != (n, k) or \
            weight.stride() != (k, 1) or scale.dtype != torch.float32 or \
            tuple(scale.shape) != want or scale.stride(1) != 1:
        raise ValueError(f"fp8_gemv: weight {tuple(weight.shape)} {weight.dtype} and scale "
                         f"{tuple(scale.shape)} {scale.dtype} do not take a row of {k} (float8 "
                         f"e4m3 rows, float32 scales {want})")
    if gate_up:
        if n % 2 or (n // 2) % bn or bias is not None:
            raise ValueError(f"fp8_gemv: a gate/up weight has an even row count, halves of "
                             f"whole scale blocks ({bn} rows) and no bias, got {n} rows")
        n //= 2
    out = checked_out("fp8_gemv", x, n, k, bias, residual, norm, out, out_dtype)
    c = dict(cfg or launch_config(n, k, gate_up=gate_up))
    check_launch("fp8_gemv", c["BLOCK_N"], c.setdefault("BLOCK_K", 128))
    block_n = _rows_per_program(c.pop("BLOCK_N"), bn)
    c["BLOCK_K"] = min(c["BLOCK_K"], triton.next_power_of_2(k))
    r = x if residual is None else residual
    _fp8_gemv[(triton.cdiv(n, block_n), m)](
        x, x.stride(0), x if norm is None else norm[0], weight, scale, scale.stride(0),
        x if bias is None else bias, r, r.stride(0), out, out.stride(0), n, k,
        0.0 if norm is None else float(norm[1]), bn, bk, NORM=norm is not None,
        HAS_B=bias is not None, HAS_R=residual is not None, SILU=gate_up, BLOCK_N=block_n,
        **c, **pdl(x))
    return out
