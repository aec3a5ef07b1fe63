"""Triton kernels over weights kept in GGUF blocks (`shards.quant_blocks`): a GEMV for steps of
a few rows that dequantizes in registers (with `kernels.gemv`'s norm prologue and residual /
SiLU * up epilogues, for the fused decode step of `shards.fused`), and a dequantizer of a tile
of rows (prefill: the tile to the activations' dtype, then torch's matmul on the tensor
cores).

The dequantizer addresses each value's bytes from its index (block, position in the block) as
ggml lays the types out (`_values`). The GEMV instead walks the blocks as stored (`_chunk_dot`):
each quant byte loaded once, in runs of contiguous bytes the compiler turns into vector loads,
both nibbles of it used, and each block's d / scales read as 16- or 32-bit words once per row
and block, `SB` super blocks (256 values) an iteration. One jitted function serves every type:
the kernels differ by the `QT` constant. A few-row step runs the GEMV once per row (the grid's
second axis): the weight's bytes are read from DRAM once and from L2 for the other rows.

The values equal `gguf.quants.dequantize`'s up to float32 contraction (the compiler may fuse
`d * q - m` into one FMA): `tests/gpu/test_quant_gemv.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.gemv_operands import check_launch, checked_out
from layersplit.shards.kernels.pdl import pdl, pdl_start
from layersplit.shards.kernels.quant_planar import (
    PLANAR_QT,
    _half,
    _planar_dequant,
    _planar_gemv,
    epilogue,
)
from layersplit.shards.quant_blocks import KEPT_TYPES, planar_sections

QT_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
MAX_ROWS = 16  # the most rows `quant_gemv` takes; more: `quant_linear.quant_matmul`
EXPERT_ROWS = 64  # ... of (token, expert) pairs, with `experts`
# a value's 4 bits, passed to the planar GEMV as an argument (`int4_gemv.FIELD`: as a constant
# the sm_90 code moves each shifted copy into a register before each AND)
FIELD = 15
# `_chunk_dot`'s tile of a chunk of 256 values: G runs of L quant bytes (Q8_0: values)
_TILES = {"Q8_0": (8, 32), "Q4_0": (8, 16), "Q4_1": (8, 16), "Q4_K": (4, 32), "Q5_K": (4, 32),
          "Q6_K": (8, 16)}


@triton.jit
def _u8(P, mask):
    return tl.load(P, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(P, mask):
    """The float16 at bytes P, P + 1 (little-endian), as float32."""
    return _half(_u8(P, mask) | (_u8(P + 1, mask) << 8))


@triton.jit
def _k_six_bits(a, b, c, sub):
    """The six-bit scale and min of sub-block `sub` (0..7) of a Q4_K/Q5_K super block from its
    scale bytes sub % 4 (a), 4 + sub % 4 (b) and 8 + sub % 4 (c)."""
    lo = sub < 4
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))  # sub >= 4: a, b hold the top bits
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_scale_min(S, sub, mask):
    """`_k_six_bits` of the super block whose 12 scale bytes start at S."""
    t = sub % 4
    return _k_six_bits(_u8(S + t, mask), _u8(S + 4 + t, mask), _u8(S + 8 + t, mask), sub)


@triton.jit
def _values(W, row_bytes, offs_n, offs_k, mask, QT: tl.constexpr, QK: tl.constexpr,
            SIZE: tl.constexpr):
    """Values (BLOCK_N, BLOCK_K) of rows offs_n, columns offs_k of a matrix of `QT` blocks,
    as float32 (0 where not `mask`)."""
    kb = offs_k // QK
    j = (offs_k % QK)[None, :]
    P = W + offs_n[:, None].to(tl.int64) * row_bytes + (kb * SIZE)[None, :]
    if QT == 0:  # Q8_0: d, 32 int8
        q = _u8(P + 2 + j, mask).to(tl.int8).to(tl.float32)
        v = q * _f16(P, mask)
    elif QT <= 2:  # Q4_0: d, 16 bytes of nibbles (values 0..15 low, 16..31 high); Q4_1: d, m, ...
        if QT == 1:
            byte = _u8(P + 2 + j % 16, mask)
            nib = tl.where(j < 16, byte & 15, byte >> 4)
            v = _f16(P, mask) * (nib - 8).to(tl.float32)
        else:
            byte = _u8(P + 4 + j % 16, mask)
            nib = tl.where(j < 16, byte & 15, byte >> 4)
            v = _f16(P, mask) * nib.to(tl.float32) + _f16(P + 2, mask)
    elif QT <= 4:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, (Q5_K: 32 high-bit bytes), nibbles
        sub = j // 32
        sc, mn = _k_scale_min(P + 4, sub, mask)
        if QT == 3:
            byte = _u8(P + 16 + (j // 64) * 32 + j % 32, mask)
            q = tl.where(sub % 2 == 0, byte & 15, byte >> 4)
        else:
            byte = _u8(P + 48 + (j // 64) * 32 + j % 32, mask)
            q = tl.where(sub % 2 == 0, byte & 15, byte >> 4)
            q = q | (((_u8(P + 16 + j % 32, mask) >> sub) & 1) << 4)
        v = (_f16(P, mask) * sc) * q.to(tl.float32) - _f16(P + 2, mask) * mn
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
        half = j // 128
        w = j % 128
        lo = _u8(P + half * 64 + w % 64, mask)
        lo = tl.where(w < 64, lo & 15, lo >> 4)
        hi = (_u8(P + 128 + half * 32 + w % 32, mask) >> (2 * (w // 32))) & 3
        q = (lo | (hi << 4)) - 32
        sc = _u8(P + 192 + j // 16, mask).to(tl.int8).to(tl.float32)
        v = (_f16(P + 208, mask) * sc) * q.to(tl.float32)
    return v


@triton.jit
def _byte(word, i):
    """Byte `i` (0..3) of int32 `word`, 0..255."""
    return (word >> (8 * i)) & 255


@triton.jit
def _k_scale_min_w(w1, w2, w3, sub):
    """`_k_six_bits` from the super block's three scale words w1..w3 (bytes 4..15 as int32,
    loaded once per row and super block)."""
    t = sub % 4
    return _k_six_bits(_byte(w1, t), _byte(w2, t), _byte(w3, t), sub)


@triton.jit
def _xs(xrow, NW, zr, offs, K, scale, NORM: tl.constexpr, dt):
    """The activations at `offs` as float32 (0 past K), RMS-normalized when NORM as
    `kernels.gemv._gemv` rounds them; loaded in the weights' shape (`zr`: zeros (BLOCK_N, 1,
    1), each row's threads read x from L1) so that the products need no layout change."""
    mask = offs < K
    x = tl.load(xrow + zr + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(NW + zr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (nw * (x * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x


@triton.jit
def _chunk_dot(acc, W, WW, row_bytes, rows, kc, K, mask_n, xrow, NW, scale, dt, QT: tl.constexpr,
               SIZE: tl.constexpr, G: tl.constexpr, L: tl.constexpr, SB: tl.constexpr,
               NORM: tl.constexpr):
    """`acc` (BLOCK_N, G * SB, L) plus the products of rows `rows`' values at columns kc * C
    .. + C, C = 256 * SB, with x (one FMA a value). Each quant byte is loaded once, in runs of
    L contiguous bytes (the compiler's vector loads), both its nibbles used; a block's d /
    scales are read as 16- or 32-bit words (`WW`, the blocks viewed as int16 or int32) once per
    row and block, not per value. The values are `_values`' (the same float32 expressions)."""
    g = tl.arange(0, G * SB)[None, :, None]
    t = tl.arange(0, L)[None, None, :]
    row = rows[:, None, None].to(tl.int64) * row_bytes
    mrow = mask_n[:, None, None]
    zr = tl.zeros([rows.shape[0], 1, 1], dtype=tl.int32)  # (x in the weights' shape: `_xs`)
    z = t * 0  # (d / scales too: loads of (rows, groups, 1) get a layout of their own)
    if QT <= 2:  # G = 8 blocks of 32 values per 256
        b = kc * (8 * SB) + g  # (the block)
        gmask = mrow & (b * 32 < K)
        blk = row + b * SIZE  # (bytes)
        if QT == 0:  # Q8_0: int16 d, 32 int8; L = 32
            d = _half(tl.load(WW + blk // 2 + z, mask=gmask, other=0))
            q = tl.load(W + blk + 2 + t, mask=gmask, other=0).to(tl.int8).to(tl.float32)
            acc += (q * d) * _xs(xrow, NW, zr, b * 32 + t, K, scale, NORM, dt)
        else:  # Q4_0 / Q4_1: 16 bytes, value t low nibble, t + 16 high; L = 16
            byte = tl.load(W + blk + 2 * QT + t, mask=gmask, other=0).to(tl.int32)
            x0 = _xs(xrow, NW, zr, b * 32 + t, K, scale, NORM, dt)
            x1 = _xs(xrow, NW, zr, b * 32 + 16 + t, K, scale, NORM, dt)
            if QT == 1:  # int16 d
                d = _half(tl.load(WW + blk // 2 + z, mask=gmask, other=0))
                acc += (d * ((byte & 15) - 8).to(tl.float32)) * x0
                acc += (d * ((byte >> 4) - 8).to(tl.float32)) * x1
            else:  # int32 d | m << 16
                dm = tl.load(WW + blk // 4 + z, mask=gmask, other=0)
                d = _half(dm)
                m = _half(dm >> 16)
                acc += (d * (byte & 15).to(tl.float32) + m) * x0
                acc += (d * (byte >> 4).to(tl.float32) + m) * x1
    elif QT <= 4:  # Q4_K / Q5_K: G = 4 pairs of sub-blocks 2i (low nibbles), 2i + 1 (high)
        sb = kc * SB + g // 4  # (the super block)
        i = g % 4
        gmask = mrow & (sb * 256 < K)
        blk = row + sb * SIZE
        hdr = WW + blk // 4 + z  # (int32 words: d | dmin << 16, then the 12 scale bytes)
        dd = tl.load(hdr, mask=gmask, other=0)
        w1 = tl.load(hdr + 1, mask=gmask, other=0)
        w2 = tl.load(hdr + 2, mask=gmask, other=0)
        w3 = tl.load(hdr + 3, mask=gmask, other=0)
        d = _half(dd)
        dmin = _half(dd >> 16)
        sc0, mn0 = _k_scale_min_w(w1, w2, w3, 2 * i)
        sc1, mn1 = _k_scale_min_w(w1, w2, w3, 2 * i + 1)
        scale0, off0 = d * sc0, dmin * mn0
        scale1, off1 = d * sc1, dmin * mn1
        if QT == 3:
            byte = tl.load(W + blk + 16 + i * 32 + t, mask=gmask, other=0).to(tl.int32)
            q0 = byte & 15
            q1 = byte >> 4
        else:
            byte = tl.load(W + blk + 48 + i * 32 + t, mask=gmask, other=0).to(tl.int32)
            qh = tl.load(W + blk + 16 + t, mask=gmask, other=0).to(tl.int32)
            q0 = (byte & 15) | (((qh >> (2 * i)) & 1) << 4)
            q1 = (byte >> 4) | (((qh >> (2 * i + 1)) & 1) << 4)
        x0 = _xs(xrow, NW, zr, sb * 256 + i * 64 + t, K, scale, NORM, dt)
        x1 = _xs(xrow, NW, zr, sb * 256 + i * 64 + 32 + t, K, scale, NORM, dt)
        acc += (scale0 * q0.to(tl.float32) - off0) * x0
        acc += (scale1 * q1.to(tl.float32) - off1) * x1
    else:  # Q6_K: G = 8 runs of 16 ql bytes (low nibbles: values j0, high: j0 + 64); run r:
        # half h = r // 4, c = r // 2 % 2
        sb = kc * SB + g // 8
        r = g % 8
        gmask = mrow & (sb * 256 < K)
        blk = row + sb * SIZE
        h = r // 4
        c = (r // 2) % 2
        lh = r % 2
        ql = tl.load(W + blk + r * 16 + t, mask=gmask, other=0).to(tl.int32)
        qh = tl.load(W + blk + 128 + h * 32 + lh * 16 + t, mask=gmask, other=0).to(tl.int32)
        q0 = ((ql & 15) | (((qh >> (2 * c)) & 3) << 4)) - 32
        q1 = ((ql >> 4) | (((qh >> (2 * c + 4)) & 3) << 4)) - 32
        hw = WW + blk // 2 + z  # (int16 words)
        d = _half(tl.load(hw + 104, mask=gmask, other=0))
        i0 = r + 4 * h  # the int8 scale of the 16 values of low nibbles (high: i0 + 4)
        s0 = tl.load(hw + 96 + i0 // 2, mask=gmask, other=0).to(tl.int32)
        s1 = tl.load(hw + 98 + i0 // 2, mask=gmask, other=0).to(tl.int32)
        sc0 = ((s0 >> (8 * (i0 % 2))) & 255).to(tl.int8).to(tl.float32)
        sc1 = ((s1 >> (8 * (i0 % 2))) & 255).to(tl.int8).to(tl.float32)
        j0 = sb * 256 + h * 128 + c * 32 + lh * 16 + t
        acc += ((d * sc0) * q0.to(tl.float32)) * _xs(xrow, NW, zr, j0, K, scale, NORM, dt)
        acc += ((d * sc1) * q1.to(tl.float32)) * _xs(xrow, NW, zr, j0 + 64, K, scale, NORM, dt)
    return acc


@triton.jit
def _quant_gemv(X, s_x, NW, W, WW, row_bytes, B, R, s_r, Y, s_y, N, K, eps, E_IDX, E_ROWS,
                QT: tl.constexpr, SIZE: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
                NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
                SILU: tl.constexpr, HAS_E: tl.constexpr, BLOCK_N: tl.constexpr,
                SB: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of N outputs, row m): y[m, offs_n] = W[offs_n] . x[m] (+ b), 256 * SB
    columns at a time (`_chunk_dot`), with the prologue and epilogues of `kernels.gemv.
    _gemv`, rounded as it rounds them: NORM, the row's RMSNorm first; SILU, rows N + offs_n are
    the up half and y = SiLU(g) * u; HAS_R, a residual added; HAS_E, row m's weight is expert
    E_IDX[m]'s, rows E_IDX[m] * E_ROWS on of the stacked experts."""
    pdl_start(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)
    if HAS_E:
        rows_n += tl.load(E_IDX + m).to(tl.int64) * E_ROWS
    dt = X.dtype.element_ty
    xrow = X + m * s_x
    k3 = (tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]  # (1, 8, 32)
    scale = 1.0
    if NORM:
        sq = tl.zeros([1, 8, 32], dtype=tl.float32)
        for kc in range(0, tl.cdiv(K, 256)):
            offs = kc * 256 + k3
            xs = tl.load(xrow + offs, mask=offs < K, other=0.0).to(tl.float32)
            sq += xs * xs
        scale = tl.rsqrt(tl.sum(sq) / K + eps)  # (a scalar: no layout to convert)
    acc = tl.zeros([BLOCK_N, G * SB, L], dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros([BLOCK_N, G * SB, L], dtype=tl.float32)
    for kc in range(0, tl.cdiv(K, 256 * SB)):
        acc = _chunk_dot(acc, W, WW, row_bytes, rows_n, kc, K, mask_n, xrow, NW, scale, dt,
                         QT, SIZE, G, L, SB, NORM)
        if SILU:
            acc_u = _chunk_dot(acc_u, W, WW, row_bytes, rows_n + N, kc, K, mask_n, xrow, NW,
                               scale, dt, QT, SIZE, G, L, SB, NORM)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    y_u = y
    if SILU:
        y_u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    epilogue(y, y_u, B, R, s_r, Y, s_y, m, offs_n, mask_n, dt, HAS_B, HAS_R, SILU)


@triton.jit
def _dequant(W, row_bytes, Y, N, K, QT: tl.constexpr, QK: tl.constexpr, SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    v = _values(W, row_bytes, offs_n, offs_k, mask, QT, QK, SIZE)
    tl.store(Y + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], v.to(Y.dtype.element_ty),
             mask=mask)


def planar_launch_config(n: int, k: int, qtype: str, gate_up: bool = False) -> dict:
    """The planar GEMV's launch shape for `n` outputs of `k` inputs of `qtype` (`gate_up`: the
    fused SiLU * up step, `n` its outputs: the shape of the GEMV over all 2n rows, so that its
    sums are those of that GEMV then SiLU * up apart, `quant_linear.PLANAR_SILU_APART`, bit for
    bit). Untimed: `int4_gemv.launch_config`'s plain shapes (a chunk of as many quant bytes a
    program; as Triton 3.9 and ptxas compile them for sm_90, no spills, the loop ~5.5 SASS
    instructions a Q4_K value and ~6.4 a Q6_K one at 8 x 512, ~4.7 and ~5.7 at 16 x 512 on 2
    warps, without STAGES); `bench/quant_gemv.py --sweep --types Q4_K,Q6_K` times the others
    (`PLANAR_SWEEP`). STAGES: chunks in flight a program (`quant_planar._planar_gemv`; 3 adds
    ~0.5 instructions a value, reading them back from shared memory)."""
    if gate_up:
        n *= 2
    if n >= 16384:
        return {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "STAGES": 3}
    return {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "STAGES": 3}


def _type_args(qtype: str) -> dict:
    t = KEPT_TYPES[qtype]
    return {"QT": QT_IDS[qtype], "QK": t.block, "SIZE": t.size}


def _check(blocks: torch.Tensor, qtype: str, k: int, planar: bool = False) -> None:
    if qtype not in (PLANAR_QT if planar else QT_IDS):
        raise ValueError(f"quant kernels: type {qtype} is not kept quantized"
                         f"{' in planar rows' if planar else ''}")
    want = planar_sections(k, qtype)[3] if planar else KEPT_TYPES[qtype].row_bytes(k)
    what = "planar rows" if planar else "blocks"
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.stride() != (want, 1):
        raise ValueError(f"quant kernels: {qtype} {what} of rows of {k} are contiguous "
                         f"(rows, {want}) uint8, got {tuple(blocks.shape)} {blocks.dtype}")
    if planar and blocks.data_ptr() % 4:  # (read as int32 words)
        raise ValueError(f"quant kernels: {qtype} planar rows must start at a multiple of 4 "
                         f"bytes, got address {blocks.data_ptr():#x}")


def _planar_args(blocks: torch.Tensor, qtype: str, k: int) -> tuple[list, dict]:
    """The planar kernels' leading arguments (the rows as int16 and int32 words, a row's
    words) and their sections' byte offsets (`quant_planar`)."""
    high, scales, words, row = planar_sections(k, qtype)
    return ([blocks.view(torch.int16), blocks.view(torch.int32), row // 4],
            {"QT": PLANAR_QT[qtype], "QH": high, "SM": scales, "DW": words})


def quant_gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: str,
               bias: torch.Tensor | None = None, *,
               norm: tuple[torch.Tensor, float] | None = None,
               residual: torch.Tensor | None = None, gate_up: bool = False,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               experts: tuple[torch.Tensor, int] | None = None,
               cfg: dict | None = None, planar: bool = False) -> torch.Tensor:
    """F.linear of rows `x` (M, K), M <= MAX_ROWS, by the (N, K) matrix held as `qtype`
    `blocks` (N, row_bytes), summed in float32 and rounded to x's dtype, with `kernels.gemv.
    gemv`'s options: `norm` = (weight, eps), each row's RMSNorm first; `gate_up`, the blocks
    are the fused gate/up weight (2F rows) and the result SiLU(g) * u (M, F); `residual`
    (M, N) added. Stored as `out_dtype` (default x's), or into `out` (M, N or F; rows may be
    strided: a slice of a wider result). `experts` = (ids (M,), rows per expert): `blocks` are
    experts stacked by rows, and row m is multiplied by expert ids[m]'s (N of its rows, or 2F
    with `gate_up`: gate rows then up rows), up to `EXPERT_ROWS` rows. `cfg`: a launch shape
    (BLOCK_N, num_warps, SB: super blocks of 256 values an iteration) other than the default
    (not measured yet). `planar`: `blocks` are K-quant rows repacked by `quant_blocks.
    to_planar`, read by `kernels.quant_planar` (`cfg`: BLOCK_N, BLOCK_K, num_warps, powers of
    two, BLOCK_K at least 32, and STAGES, 1 by default; default `planar_launch_config`'s)."""
    most = MAX_ROWS if experts is None else EXPERT_ROWS
    if x.dim() != 2 or not 1 <= x.shape[0] <= most or x.stride(1) != 1:
        raise ValueError(f"quant_gemv: x must be 1 to {most} rows (M, K) of contiguous "
                         f"values, got {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    _check(blocks, qtype, k, planar)
    n = blocks.shape[0] if experts is None else experts[1]
    if experts is not None and (experts[0].shape != (m,) or blocks.shape[0] % n):
        raise ValueError(f"quant_gemv: experts of {n} rows: {blocks.shape[0]} stacked rows, "
                         f"ids {tuple(experts[0].shape)} for {m} rows")
    if gate_up:
        if n % 2 or bias is not None:
            raise ValueError(f"quant_gemv: a gate/up weight has an even row count and no "
                             f"bias, got {n} rows{' and a bias' if bias is not None else ''}")
        n //= 2
    out = checked_out("quant_gemv", x, n, k, bias, residual, norm, out, out_dtype)
    r = x if residual is None else residual
    if planar:
        c = dict(cfg or planar_launch_config(n, k, qtype, gate_up))
        block_n = c.pop("BLOCK_N")
        block_k = max(32, min(c.pop("BLOCK_K", 512), triton.next_power_of_2(k)))
        check_launch("quant_gemv", block_n, block_k)
        c.setdefault("STAGES", 1)
        (w16, w32, row_words), consts = _planar_args(blocks, qtype, k)
        _planar_gemv[(triton.cdiv(n, block_n), m)](
            x, x.stride(0), x if norm is None else norm[0], w16, w32, row_words // 4,
            x if bias is None else bias, r, r.stride(0), out, out.stride(0), n, k, k // 32,
            FIELD, 0.0 if norm is None else float(norm[1]), x if experts is None else experts[0],
            0 if experts is None else experts[1], **consts, NORM=norm is not None,
            HAS_B=bias is not None, HAS_R=residual is not None, SILU=gate_up,
            HAS_E=experts is not None, BLOCK_N=block_n, BLOCK_K=block_k, **c, **pdl(x))
        return out
    c = dict(cfg or {"BLOCK_N": 4, "num_warps": 4})
    block_n = c.pop("BLOCK_N")
    c.setdefault("SB", min(4, 1 << (triton.cdiv(k, 256).bit_length() - 1)))  # (no idle tile)
    tile = _TILES[qtype]  # (G, L): see `_chunk_dot`
    word = torch.int32 if KEPT_TYPES[qtype].size % 4 == 0 else torch.int16
    if blocks.data_ptr() % word.itemsize:  # (d / scales are read as words: `_chunk_dot`)
        raise ValueError(f"quant_gemv: {qtype} blocks must start at a multiple of "
                         f"{word.itemsize} bytes, got address {blocks.data_ptr():#x}")
    words = blocks.view(word)
    _quant_gemv[(triton.cdiv(n, block_n), m)](
        x, x.stride(0), x if norm is None else norm[0], blocks, words, blocks.shape[1],
        x if bias is None else bias, r, r.stride(0), out, out.stride(0), n, k,
        0.0 if norm is None else float(norm[1]), x if experts is None else experts[0],
        0 if experts is None else experts[1], QT=QT_IDS[qtype],
        SIZE=KEPT_TYPES[qtype].size, G=tile[0], L=tile[1], NORM=norm is not None,
        HAS_B=bias is not None, HAS_R=residual is not None, SILU=gate_up,
        HAS_E=experts is not None, BLOCK_N=block_n, **c, **pdl(x))
    return out


def dequantize(blocks: torch.Tensor, qtype: str, k: int, dtype: torch.dtype,
               planar: bool = False) -> torch.Tensor:
    """The (N, k) matrix held as `qtype` `blocks` (N, row_bytes; `planar`: planar rows), in
    `dtype`."""
    _check(blocks, qtype, k, planar)
    n = blocks.shape[0]
    y = torch.empty(n, k, dtype=dtype, device=blocks.device)
    if planar:
        lead, consts = _planar_args(blocks, qtype, k)
        _planar_dequant[(triton.cdiv(n, 16), triton.cdiv(k, 256))](
            *lead, y, n, k, **consts, BLOCK_N=16, BLOCK_K=256)
        return y
    _dequant[(triton.cdiv(n, 16), triton.cdiv(k, 256))](blocks, blocks.shape[1], y, n, k,
                                                         **_type_args(qtype), BLOCK_N=16,
                                                         BLOCK_K=256)
    return y
