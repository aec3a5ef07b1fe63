"""Triton kernels over K-quant rows repacked into the planar layout (`quant_blocks.to_planar`):
the GEMV of `kernels.quant_gemv` for Q4_K, Q5_K and Q6_K, and the dequantizer of a tile.

At batch 1 these kernels are bound by the instructions a value costs, not by the bytes (the
stored layout's Q4_K GEMV spent ~38 SASS instructions a value decoding six-bit scales and
addressing 144-byte blocks). Here a thread takes 16-byte runs of quants, each a whole group
of 32 values with one scale and min, and turns a 4-bit field into a float32 without a
conversion instruction: OR-ing it into the mantissa of 2**23 (`MAGIC`) gives 2**23 + q * 2**p
exactly (p its bit position), less 2**23 gives q * 2**p, and the group's scale is multiplied
by 2**-p once (a power of two: exact). So a value is an AND/OR, a subtraction, the value's
FMA and the product's FMA; the Q5_K / Q6_K high bits are OR-ed into the same field from words
shifted once per 8 values. The values are gguf's float32 expressions, `(d * sc) * q - dmin *
m` (Q4_K, Q5_K) and `(d * sc) * (q - 32)` (Q6_K), up to float32 contraction of the first.

A program takes BLOCK_N rows (rows a thread holds: x, loaded and normalized once, serves each)
and CG groups of 32 values an iteration.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # float32 2**23: an integer below 2**23 OR-ed in is exact
PLANAR_QT = {"Q4_K": 3, "Q5_K": 4, "Q6_K": 5}  # (the ids of `quant_gemv.QT_IDS`)


@triton.jit
def _half(word):
    """The float16 whose bits are the low 16 of int32/int16 `word`, as float32."""
    return word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _exact(bits, bias):
    """float32 of `bits` (`MAGIC` | an integer field), less `bias` (2**23 + offset)."""
    return bits.to(tl.float32, bitcast=True) - bias


@triton.jit
def _group_scales(sm, dw, QT: tl.constexpr):
    """A group's (scale, min) (Q4_K / Q5_K: d * sc, dmin * m) or (scale of values 0..15,
    scale of 16..31) (Q6_K: d * int8 scales) from its two scale bytes `sm` (int32, low 16
    bits) and its super block's word `dw`."""
    lo = (sm & 255) | MAGIC
    hi = ((sm >> 8) & 255) | MAGIC
    d = _half(dw)
    if QT == 5:
        return (d * _exact(lo ^ 128, 8388736.0), d * _exact(hi ^ 128, 8388736.0))
    return d * _exact(lo, 8388608.0), _half(dw >> 16) * _exact(hi, 8388608.0)


@triton.jit
def rms_scale(xrow, K, eps, BLOCK_K: tl.constexpr):
    """The RMSNorm scale of the row at `xrow` (K values), as `kernels.gemv._gemv` computes it:
    the GEMVs' norm prologue."""
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(xrow + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        sq += xs * xs
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def activations(xrow, NW, offs_k, mask_k, scale, NORM: tl.constexpr, dt):
    """The row's activations at `offs_k` (any shape) as float32, 0 where not `mask_k`; NORM:
    normalized by `scale` (`rms_scale`) and the norm's weight `NW`, rounded as `fused.rms_norm`
    rounds them (w * dt(x * scale), in dt)."""
    x = tl.load(xrow + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(NW + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = (nw * (x * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x


@triton.jit
def epilogue(acc, acc_u, B, R, s_r, Y, s_y, m, offs_n, mask_n, dt, HAS_B: tl.constexpr,
             HAS_R: tl.constexpr, SILU: tl.constexpr):
    """`kernels.gemv._gemv`'s epilogues on the float32 sums of rows offs_n (and of the up rows:
    `acc_u`, with SILU), rounded as it rounds them; stores row m's outputs."""
    y = acc
    if HAS_B:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = y.to(dt)
    if SILU:
        g = y.to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (sg * u).to(dt)
    if HAS_R:
        r = tl.load(R + m * s_r + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dt)
    tl.store(Y + m * s_y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


@triton.jit
def _xs(xrow, NW, offs, mask, scale, NORM: tl.constexpr, EVEN: tl.constexpr, dt):
    """Activations at `offs` (BLOCK_N, CG, 4: the rows' offsets zeros) as float32,
    RMS-normalized when NORM as `kernels.gemv._gemv` rounds them. (Loaded in the weights'
    shape, so that they take the weights' layout; a thread's rows load the same addresses,
    which the compiler merges.)"""
    if EVEN:
        x = tl.load(xrow + offs).to(tl.float32)
    else:
        x = tl.load(xrow + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        if EVEN:
            nw = tl.load(NW + offs).to(tl.float32)
        else:
            nw = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
        x = (nw * (x * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x


@triton.jit
def _load(P, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(P)
    return tl.load(P, mask=mask, other=0)


@triton.jit
def _chunk_dot(acc, W16, W32, row, c, G, mask_n, xrow, NW, scale, dt, QT: tl.constexpr,
               QH: tl.constexpr, SM: tl.constexpr, DW: tl.constexpr, CG: tl.constexpr,
               NORM: tl.constexpr, EVEN: tl.constexpr):
    """`acc` (BLOCK_N, CG, 4) plus the products of rows `row` (word offsets, (BLOCK_N, 1, 1))
    with x over groups c * CG .. + CG. QH / SM / DW: the high bits', scales' and words'
    offsets in a row (int32 words; SM in int16 halves)."""
    gg = tl.arange(0, CG)
    ee = tl.arange(0, 4)
    g = c * CG + gg[None, :, None]  # (1, CG, 1)
    e = ee[None, None, :]  # (1, 1, 4)
    mask = mask_n[:, None, None] & (g < G)
    zr = tl.zeros([mask_n.shape[0], 1, 1], dtype=tl.int32)
    xmask = (g < G) & (zr == 0)
    w = _load(W32 + row + g * 4 + e, mask, EVEN)  # word e of group g: value 4j + e at 4j
    w16 = w >> 16  # (planes 4..7 at bits 0..15)
    g2 = c * CG + gg[None, :]  # (scales: loaded (BLOCK_N, CG), then broadcast)
    row2 = tl.reshape(row, (row.shape[0], 1))
    mask2 = mask_n[:, None] & (g2 < G)
    sm = _load(W16 + 2 * row2 + SM + g2, mask2, EVEN).to(tl.int32)
    dw = _load(W32 + row2 + DW + g2 // 8, mask2, EVEN)
    s_a, s_b = _group_scales(sm, dw, QT)
    s_a = s_a[:, :, None]
    s_b = s_b[:, :, None]
    if QT == 4:  # bit 4j + e: value (e, j)'s fifth bit, to bit 4 (j % 4) + 4
        qh = _load(W32 + row + QH + g, mask, EVEN)
        h_a = qh << (4 - e)
        h_b = qh >> (12 + e)
    elif QT == 5:  # word e // 2, bits 4j + 2 (e % 2): its two high bits, to 4 (j % 4) + 4
        qh = _load(W32 + row + QH + 2 * g + e // 2, mask, EVEN)
        o = 2 * (e % 2)
        h_a = qh << (4 - o)
        h_b = qh >> (12 + o)
    xoffs = zr + g * 32 + e
    for j in tl.static_range(8):
        p = 4 * (j % 4)
        if j < 4:
            bits = (w & (15 << p)) | MAGIC
        else:
            bits = (w16 & (15 << p)) | MAGIC
        if QT == 4:
            if j < 4:
                bits = bits | (h_a & (16 << p))
            else:
                bits = bits | (h_b & (16 << p))
        elif QT == 5:
            if j < 4:
                bits = bits | (h_a & (48 << p))
            else:
                bits = bits | (h_b & (48 << p))
        x = _xs(xrow, NW, xoffs + 4 * j, xmask, scale, NORM, EVEN, dt)
        step = 1.0 / (1 << p)  # (the field is q * 2**p)
        if QT == 5:
            q = _exact(bits, 8388608.0 + 32.0 * (1 << p))  # (q - 32) * 2**p
            if j < 4:
                v = (s_a * step) * q
            else:
                v = (s_b * step) * q
        else:
            v = (s_a * step) * _exact(bits, 8388608.0) - s_b
        acc += v * x
    return acc


@triton.jit
def _planar_gemv(X, s_x, NW, W16, W32, row_words, B, R, s_r, Y, s_y, N, K, eps, E_IDX,
                 E_ROWS, QT: tl.constexpr, QH: tl.constexpr, SM: tl.constexpr,
                 DW: tl.constexpr, NORM: tl.constexpr, HAS_B: tl.constexpr,
                 HAS_R: tl.constexpr, SILU: tl.constexpr, HAS_E: tl.constexpr,
                 EVEN: tl.constexpr, BLOCK_N: tl.constexpr, CG: tl.constexpr):
    """`quant_gemv._quant_gemv` over planar rows (`row_words` int32 words a row): program
    (block of N outputs, row m), CG groups of 32 values an iteration (`_chunk_dot`)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)
    if HAS_E:
        rows_n += tl.load(E_IDX + m).to(tl.int64) * E_ROWS
    dt = X.dtype.element_ty
    xrow = X + m * s_x
    G = K // 32
    scale = 1.0
    if NORM:
        k2 = tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :]
        sq = tl.zeros([8, 32], dtype=tl.float32)
        for kc in range(0, tl.cdiv(K, 256)):
            offs = kc * 256 + k2
            xs = tl.load(xrow + offs, mask=offs < K, other=0.0).to(tl.float32)
            sq += xs * xs
        scale = tl.rsqrt(tl.sum(sq) / K + eps)
    row = (rows_n * row_words)[:, None, None]
    acc = tl.zeros([BLOCK_N, CG, 4], dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros([BLOCK_N, CG, 4], dtype=tl.float32)
        row_u = row + N * row_words
    for c in range(0, tl.cdiv(G, CG)):
        acc = _chunk_dot(acc, W16, W32, row, c, G, mask_n, xrow, NW, scale, dt, QT, QH, SM,
                         DW, CG, NORM, EVEN)
        if SILU:
            acc_u = _chunk_dot(acc_u, W16, W32, row_u, c, G, mask_n, xrow, NW, scale, dt, QT,
                               QH, SM, DW, CG, NORM, EVEN)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    y_u = y
    if SILU:
        y_u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    epilogue(y, y_u, B, R, s_r, Y, s_y, m, offs_n, mask_n, dt, HAS_B, HAS_R, SILU)


@triton.jit
def planar_values(W16, W32, row_words, offs_n, offs_k, mask, QT: tl.constexpr,
                  QH: tl.constexpr, SM: tl.constexpr, DW: tl.constexpr):
    """Values (BLOCK_N, BLOCK_K) of rows offs_n, columns offs_k of planar rows, as float32
    (0 where not `mask`): the prefill tiles' and the embedding's dequantizer."""
    row = offs_n[:, None].to(tl.int64) * row_words
    g = (offs_k // 32)[None, :]
    r = (offs_k % 32)[None, :]
    j = r // 4
    e = r % 4
    q = (tl.load(W32 + row + g * 4 + e, mask=mask, other=0) >> (4 * j)) & 15
    if QT == 4:
        q = q | (((tl.load(W32 + row + QH + g, mask=mask, other=0) >> r) & 1) << 4)
    elif QT == 5:
        h = tl.load(W32 + row + QH + 2 * g + e // 2, mask=mask, other=0)
        q = q | (((h >> (4 * j + 2 * (e % 2))) & 3) << 4)
    sm = tl.load(W16 + 2 * row + SM + g, mask=mask, other=0).to(tl.int32)
    dw = tl.load(W32 + row + DW + g // 8, mask=mask, other=0)
    s_a, s_b = _group_scales(sm, dw, QT)
    if QT == 5:
        return tl.where(j < 4, s_a, s_b) * (q - 32).to(tl.float32)
    return s_a * q.to(tl.float32) - s_b


@triton.jit
def _planar_dequant(W16, W32, row_words, Y, N, K, QT: tl.constexpr, QH: tl.constexpr,
                    SM: tl.constexpr, DW: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    v = planar_values(W16, W32, row_words, offs_n, offs_k, mask, QT, QH, SM, DW)
    tl.store(Y + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], v.to(Y.dtype.element_ty),
             mask=mask)
