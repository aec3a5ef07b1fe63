"""A Triton GEMV over GPTQ / AWQ weights kept in int4 (`layers.int4_linear`, the layout of
`int4.Int4Weight`: rows = outputs, eight 4-bit values an int32 word along K, a uint8 zero and a
float32 scale per (row, group)), for steps of a few rows, with `kernels.gemv`'s norm prologue
and residual / SiLU * up epilogues (the fused decode step of `shards.fused`).

Program (block of BLOCK_N outputs, row m): each chunk of BLOCK_K inputs is BLOCK_K / 8 words of
each of its rows, a (BLOCK_N, BLOCK_K / SUB, SUB / 8) tile (sub-chunks of SUB inputs, their
words), loaded once; the chunk's activations are split into eight such tiles, value i of each
word's. Without act order and with groups of a whole number of words (`GROUPED`), SUB is the
widest power of two dividing the group (at most BLOCK_K), so a sub-chunk lies in one group and a
chunk spans one or several: a zero and a scale are loaded a row and sub-chunk and broadcast over
its words (GPTQ's zeros, v1's offset added, and AWQ's are alike: a byte a row and group,
`int4.repack_int4`). A value is taken as `quant_planar` takes its own, without an integer
conversion: the 4-bit field at bit p (0, 4, 8, 12 of the word's low or high half) OR-ed into the
mantissa of 2**23 is 2**23 + q 2**p, less 2**23 + zero 2**p is (q - zero) 2**p, exact, and the
activation was scaled by 2**-p (exact); so a value costs an AND/OR, a subtraction and an FMA
into the word's sum of (q - zero) x, which is then multiplied by the group's scale. Else (act
order's `g_idx`, or groups of a fraction of a word) SUB is BLOCK_K and each value's zero and
scale are gathered by its group, the product (q - zero) * scale * x. Either way the weight's
values are those of dequantizing (exact in float32: a 5-bit integer times a float16-valued
scale), and the float32 sums are within float32's rounding of dequantize-then-matmul
(`tests/gpu/test_int4_gemv.py`). A few-row step runs it once per row (the grid's second axis):
the weight's bytes come from DRAM once and from L2 for the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.int4 import kept_layout_error
from layersplit.shards.kernels.gemv_operands import check_launch, check_rows, checked_out
from layersplit.shards.kernels.pdl import pdl, pdl_start
from layersplit.shards.kernels.quant_planar import (
    activations,
    epilogue,
    nibble_dot,
    rms_scale,
    split8,
)

MAX_ROWS = 16  # the most rows `int4_gemv` takes; more: `layers.int4_linear.int4_matmul`
WORD = 8  # inputs a word: groups of a multiple of it take the GROUPED path
# a value's 4 bits, passed to the kernel as an argument: as a constant, the sm_90 code moved
# each of its shifted copies into a register before each AND (a move every other value)
FIELD = 15


def launch_config(n: int, k: int, gate_up: bool = False, gathered: bool = False) -> dict:
    """The launch shape for `n` outputs of `k` inputs (`gate_up`: the fused SiLU * up step, `n`
    its outputs, half the weight's rows; `gathered`: each value's zero and scale gathered, act
    order's path, whose fused gate/up step at the shape below spills registers on sm_90, so it
    takes chunks of 128 inputs of 16 rows). From the sweep on an H200 at the Llama-8B widths
    (`bench/quant_gemv.py --sweep --types INT4`, bench/RESULTS.md's Q9): 8 rows of 1024 inputs on
    4 warps is within 5 % of each of qkv's, o's and down's bests (10.9, 9.1, 24.6 us against 12.6,
    11.1, 33.4 at 8 x 512 on 2); the unfused gate/up's and the fused step's shapes were within
    5 % of their bests already."""
    if gate_up and gathered:
        return {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}
    if gate_up:
        return {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}
    if n >= 16384:
        return {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}
    return {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}


@triton.jit
def _chunk_dot(acc, W, Z, S, GI, rows, mask_n, offs_w, xs, offs_g, mask_g, KW, G, F,
               GS: tl.constexpr, HAS_GI: tl.constexpr, GROUPED: tl.constexpr):
    """`acc` (BLOCK_N, NS, SUB / 8) plus rows `rows`' products at words `offs_w` (NS, SUB / 8)
    with the activations there, `xs`: value i of each word's (GROUPED: times 2**-(4 (i % 4))).
    GROUPED: sub-chunk s lies in one group, `offs_g` (NS,) its first input. F: 15."""
    mask_w = mask_n[:, None, None] & (offs_w < KW)[None, :, :]
    words = tl.load(W + rows[:, None, None] * KW + offs_w[None, :, :], mask=mask_w, other=0)
    if GROUPED:  # (a zero and a scale a row and sub-chunk, broadcast over its words)
        at = rows[:, None] * G + (offs_g // GS)[None, :]
        m2 = mask_n[:, None] & mask_g[None, :]
        z = tl.load(Z + at, mask=m2, other=0).to(tl.float32)[:, :, None]
        s = tl.load(S + at, mask=m2, other=0.0)[:, :, None]
        # (value i, at bit p = 4 (i % 4) of the word's low or high half: 2**23 + q 2**p less
        # 2**23 + z 2**p is (q - z) 2**p, exact; times x 2**-p, (q - z) x rounded once)
        c0 = z + 8388608.0
        c1 = z * 16.0 + 8388608.0
        c2 = z * 256.0 + 8388608.0
        c3 = z * 4096.0 + 8388608.0
        acc += s * nibble_dot(words, xs, F, c0, c1, c2, c3)  # (its sum of (q - z) x, times s)
    else:  # (each value's zero and scale, gathered by its group)
        for i in tl.static_range(8):
            offs_k = offs_w * 8 + i
            if HAS_GI:
                grp = tl.load(GI + offs_k, mask=offs_w < KW, other=0)
            else:
                grp = offs_k // GS
            at = rows[:, None, None] * G + grp[None, :, :]
            z = tl.load(Z + at, mask=mask_w, other=0).to(tl.int32)
            s = tl.load(S + at, mask=mask_w, other=0.0)
            acc += (((words >> (4 * i)) & 15) - z).to(tl.float32) * s * xs[i][None, :, :]
    return acc


@triton.jit
def _int4_gemv(X, s_x, NW, W, Z, S, GI, B, R, s_r, Y, s_y, N, K, KW, G, F, eps, GS: tl.constexpr,
               NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
               SILU: tl.constexpr, HAS_GI: tl.constexpr, GROUPED: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
               PDL: tl.constexpr = False):
    pdl_start(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    dt = X.dtype.element_ty
    xrow = X + m * s_x
    scale = 1.0
    if NORM:
        scale = rms_scale(xrow, K, eps, BLOCK_K)
    ss = tl.arange(0, BLOCK_K // SUB)
    jj = tl.arange(0, SUB // 8)
    ii = tl.arange(0, 8)
    step = ((127 - 4 * (ii % 4)) << 23).to(tl.float32, bitcast=True)  # 2**-(4 (i % 4))
    acc = tl.zeros([BLOCK_N, BLOCK_K // SUB, SUB // 8], dtype=tl.float32)
    acc_u = acc
    for w0 in range(0, KW, BLOCK_K // 8):  # (KW = K / 8 words a row, BLOCK_K / 8 a chunk)
        offs_g = w0 * 8 + ss * SUB  # (each sub-chunk's first input)
        mask_g = offs_g < K
        offs_w = w0 + (ss * (SUB // 8))[:, None] + jj[None, :]
        offs_k = offs_w[:, :, None] * 8 + ii[None, None, :]
        x = activations(xrow, NW, offs_k, offs_k < K, scale, NORM, dt)
        if GROUPED:
            x = x * step[None, None, :]
        xs = split8(x)
        acc = _chunk_dot(acc, W, Z, S, GI, rows, mask_n, offs_w, xs, offs_g, mask_g, KW, G, F,
                         GS, HAS_GI, GROUPED)
        if SILU:  # (the up half: rows N + offs_n)
            acc_u = _chunk_dot(acc_u, W, Z, S, GI, rows + N, mask_n, offs_w, xs, offs_g,
                               mask_g, KW, G, F, GS, HAS_GI, GROUPED)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    y_u = y
    if SILU:
        y_u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    epilogue(y, y_u, B, R, s_r, Y, s_y, m, offs_n, mask_n, dt, HAS_B, HAS_R, SILU)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              group: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              *, norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None, gate_up: bool = False,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              cfg: dict | None = None) -> torch.Tensor:
    """F.linear of rows `x` (M, K), M <= MAX_ROWS, by the int4 weight `qweight` / `zeros` /
    `scales` / `g_idx` of `group` inputs a group (`int4.Int4Weight`), summed in float32 and
    rounded to x's dtype, with `kernels.gemv.gemv`'s options: `norm` = (weight, eps);
    `gate_up`, the weight is the fused gate/up one (2F rows) and the result SiLU(g) * u (M, F);
    `residual` (M, N) added. Stored as `out_dtype` (default x's), or into `out` (M, N or F;
    rows may be strided). `cfg`: a launch shape (BLOCK_N, BLOCK_K, num_warps; powers of two)
    other than `launch_config`'s."""
    check_rows("int4_gemv", x, MAX_ROWS)
    m, k = x.shape
    n, g = qweight.shape[0], scales.shape[-1]
    wrong = kept_layout_error(qweight, zeros, scales, group, g_idx, k)
    if wrong:
        raise ValueError(f"int4_gemv: the weight does not take a row of {k}: {wrong}")
    if gate_up:
        if n % 2 or bias is not None:
            raise ValueError(f"int4_gemv: a gate/up weight has an even row count and no bias, "
                             f"got {n} rows")
        n //= 2
    out = checked_out("int4_gemv", x, n, k, bias, residual, norm, out, out_dtype)
    unit = group & -group  # (the widest power of two that divides a group; the group size is a
    # compile-time constant, GS: one compilation per size, its divisions shifts or multiplies)
    grouped = g_idx is None and unit >= WORD
    c = dict(cfg or launch_config(n, k, gate_up=gate_up, gathered=not grouped))
    block_n = c.pop("BLOCK_N")
    block_k = max(16, min(c.pop("BLOCK_K", 128), triton.next_power_of_2(k)))
    check_launch("int4_gemv", block_n, block_k)
    sub = min(unit, block_k) if grouped else block_k
    r = x if residual is None else residual
    _int4_gemv[(triton.cdiv(n, block_n), m)](
        x, x.stride(0), x if norm is None else norm[0], qweight, zeros, scales,
        qweight if g_idx is None else g_idx, x if bias is None else bias, r, r.stride(0), out,
        out.stride(0), n, k, k // 8, g, FIELD, 0.0 if norm is None else float(norm[1]), GS=group,
        NORM=norm is not None, HAS_B=bias is not None, HAS_R=residual is not None, SILU=gate_up,
        HAS_GI=g_idx is not None, GROUPED=grouped, BLOCK_N=block_n, BLOCK_K=block_k, SUB=sub,
        **c, **pdl(x))
    return out
