"""Triton kernels over K-quant rows repacked into the planar layout (`quant_blocks.to_planar`):
the GEMV of `kernels.quant_gemv` for Q4_K, Q5_K and Q6_K, and the dequantizer of a tile.

At batch 1 the GEMV should be bound by the weight's bytes, so a value must cost few
instructions (an H200 streams ~7e12 Q4_K values a second, against ~3.4e13 float32 lanes).
Program (block of BLOCK_N outputs, row m): each chunk of BLOCK_K inputs is NG = BLOCK_K / 32
groups of each of its rows, their quants a (BLOCK_N, NG, 4) tile of int32 words loaded 16
bytes (a group) at a time; word e of a group holds its values 8e .. 8e + 7, value j's nibble
at bit 4j. The chunk's activations (NG, 4, 8) are loaded, normalized and split once for all
rows into eight (NG, 4) tiles, value j of each word's, scaled by 2**-p (p = 4 (j % 4), exact).
A value is taken without an integer conversion: its field OR-ed into the mantissa of 2**23
(`MAGIC`) is 2**23 + q 2**p exactly (Q5_K / Q6_K: the high bits OR-ed in above the nibble,
from a word shifted once per half word), less 2**23 (Q6_K: 2**23 + 32 2**p) is (q - o) 2**p,
and its product with x 2**-p is summed into the word's dot, so a value costs an AND/OR (a
second for the high bits), a subtraction and an FMA. Once a word: the dot times the group's
scale d sc (Q6_K: the scale of its 16 values, d times the int8), less (Q4_K / Q5_K) the
group's min dmin m times the word's sum of x. The scales are the stored bytes of a group
(two a group, a word of d / dmin a super block) loaded once a row and group. So the values are
gguf's (`(d * sc) * q - dmin * m`, `(d * sc) * (q - 32)`) and the sums are within float32's
rounding of dequantize-then-matmul (`tests/gpu/test_quant_gemv.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl_start

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
def split8(x):
    """The 8 slices (...) of `x` (..., 8) along its last axis, in order."""
    c0, c1 = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2, 2]))
    a0, a2 = tl.split(c0)
    a1, a3 = tl.split(c1)
    t0, t4 = tl.split(a0)
    t2, t6 = tl.split(a2)
    t1, t5 = tl.split(a1)
    t3, t7 = tl.split(a3)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def field(src, mask):
    """2**23 + q * 2**p in float32, exact: q the field `mask` (15 << p, p <= 12; Q6_K's: 63 <<
    p, p <= 8) selects in `src`."""
    return ((src & mask) | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def nibble_dot(words, xs, F, c0, c1, c2, c3):
    """A word's eight 4-bit values (value j's at bit p = 4 (j % 4) of the word, j < 4, or of its
    high half) against their activations `xs` (value j's, times 2**-p), summed: each field as
    `field` takes it less `c0`..`c3` (the offset at p = 0, 4, 8, 12: 2**23, plus int4's zero
    times 2**p), times its x."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    hi = words >> 16
    d = (field(words, F) - c0) * x0[None, :, :]
    d += (field(words, F << 4) - c1) * x1[None, :, :]
    d += (field(words, F << 8) - c2) * x2[None, :, :]
    d += (field(words, F << 12) - c3) * x3[None, :, :]
    d += (field(hi, F) - c0) * x4[None, :, :]
    d += (field(hi, F << 4) - c1) * x5[None, :, :]
    d += (field(hi, F << 8) - c2) * x6[None, :, :]
    d += (field(hi, F << 12) - c3) * x7[None, :, :]
    return d


@triton.jit
def _field_hi(src, mask, high, hmask):
    """`field` with Q5_K's fifth bit OR-ed above the nibble: the one `hmask` (16 << p) selects
    in `high`."""
    return (((src & mask) | MAGIC) | (high & hmask)).to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(words, h_a, h_b, xs, F, QT: tl.constexpr):
    """Each Q4_K / Q5_K word's sum of q x over its eight values, the activations `xs` (value
    j's, times 2**-(4 (j % 4))): value j's field at bit p = 4 (j % 4) of the word (j < 4) or of
    its high half; Q5_K: its fifth bit at p + 4 in `h_a` (j < 4) or `h_b`."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    hi = words >> 16
    c = 8388608.0  # 2**23
    if QT == 3:
        d = nibble_dot(words, xs, F, c, c, c, c)
    else:
        H = F + 1  # (16: the fifth bit)
        d = (_field_hi(words, F, h_a, H) - c) * x0[None, :, :]
        d += (_field_hi(words, F << 4, h_a, H << 4) - c) * x1[None, :, :]
        d += (_field_hi(words, F << 8, h_a, H << 8) - c) * x2[None, :, :]
        d += (_field_hi(words, F << 12, h_a, H << 12) - c) * x3[None, :, :]
        d += (_field_hi(hi, F, h_b, H) - c) * x4[None, :, :]
        d += (_field_hi(hi, F << 4, h_b, H << 4) - c) * x5[None, :, :]
        d += (_field_hi(hi, F << 8, h_b, H << 8) - c) * x6[None, :, :]
        d += (_field_hi(hi, F << 12, h_b, H << 12) - c) * x7[None, :, :]
    return d


@triton.jit
def _word_dot6(words, h, xs, F):
    """Each Q6_K word's sum of (q - 32) x over its eight values, `h` its high bits (the
    zero-extended half: value j's at `to_planar`'s bit), the activations `xs` (value j's, times
    2**-(8 ((j // 2) % 2))). Once a word, its values' six bits are laid out a byte apart, so
    that a value's field is one AND/OR: E holds values 0, 2, 4, 6 (its nibbles, the high bits
    above them), O values 1, 3, 5, 7 (the nibbles shifted down 4); byte b of each, at p = 8b
    (b = 0, 1, or of the high half, b = 2, 3)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    e = (words & 0x0F0F0F0F) | ((h | (h << 20)) & 0x30303030)
    o = ((words >> 4) & 0x0F0F0F0F) | (((h >> 2) | (h << 18)) & 0x30303030)
    e16 = e >> 16
    o16 = o >> 16
    F6 = (F << 2) | 3  # (63: six bits)
    c0 = 8388608.0 + 32.0  # 2**23 + 32 2**p (the values' offset, exact)
    c8 = 8388608.0 + 8192.0
    d = (field(e, F6) - c0) * x0[None, :, :]
    d += (field(o, F6) - c0) * x1[None, :, :]
    d += (field(e, F6 << 8) - c8) * x2[None, :, :]
    d += (field(o, F6 << 8) - c8) * x3[None, :, :]
    d += (field(e16, F6) - c0) * x4[None, :, :]
    d += (field(o16, F6) - c0) * x5[None, :, :]
    d += (field(e16, F6 << 8) - c8) * x6[None, :, :]
    d += (field(o16, F6 << 8) - c8) * x7[None, :, :]
    return d


@triton.jit
def _chunk_dot(acc, W16, W32, rows, rw, mask_n, g, mask_g, xs, sx, F, QT: tl.constexpr,
               QH: tl.constexpr, SM: tl.constexpr, DW: tl.constexpr):
    """`acc` (BLOCK_N, NG, 4) plus rows `rows`' products over groups `g` (NG,) with the
    activations `xs` (`_word_dot`'s) and `sx` (NG, 4), each word's sum of them (Q4_K / Q5_K's
    mins); `rw` int32 words a row (a multiple of 4: a group's quants are a 16-byte load)."""
    ee = tl.arange(0, 4)[None, None, :]
    row = rows[:, None] * rw  # (BLOCK_N, 1)
    m2 = mask_n[:, None] & mask_g[None, :]
    m3 = m2[:, :, None]
    words = tl.load(W32 + row[:, :, None] + (g * 4)[None, :, None] + ee, mask=m3, other=0)
    sm = tl.load(W16 + 2 * row + SM // 2 + g[None, :], mask=m2, other=0).to(tl.int32)
    dw = tl.load(W32 + row + DW // 4 + (g // 8)[None, :], mask=m2, other=0)
    s_a, s_b = _group_scales(sm, dw, QT)  # (BLOCK_N, NG)
    if QT == 5:  # (half e: value (e, j)'s two high bits)
        qh = tl.load(W16 + 2 * row[:, :, None] + QH // 2 + (g * 4)[None, :, None] + ee,
                     mask=m3, other=0).to(tl.int32)
        d = _word_dot6(words, qh & 65535, xs, F)
    else:
        h_a = words
        h_b = words
        if QT == 4:  # (the group's word: value (e, j)'s fifth bit at 4j + e, to 4 (j % 4) + 4)
            qh = tl.load(W32 + row + QH // 4 + g[None, :], mask=m2, other=0)[:, :, None]
            h_a = qh << (4 - ee)
            h_b = qh >> (12 + ee)
        d = _word_dot(words, h_a, h_b, xs, F, QT)
    if QT == 5:  # (words 0, 1 are values 0..15: the first scale; 2, 3 the second)
        acc += tl.where(ee < 2, s_a[:, :, None], s_b[:, :, None]) * d
    else:  # (d sc times the word's sum of q x, less dmin m times its sum of x)
        acc += s_a[:, :, None] * d - s_b[:, :, None] * sx[None, :, :]
    return acc


@triton.jit
def _planar_gemv(X, s_x, NW, W16, W32, R4, B, R, s_r, Y, s_y, N, K, G, F, eps, E_IDX, E_ROWS,
                 QT: tl.constexpr, QH: tl.constexpr, SM: tl.constexpr, DW: tl.constexpr,
                 NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
                 SILU: tl.constexpr, HAS_E: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """`quant_gemv._quant_gemv` over planar rows (4 R4 int32 words a row; QH / SM / DW the
    sections' byte offsets): program (block of BLOCK_N outputs, row m), BLOCK_K inputs (NG =
    BLOCK_K / 32 groups) an iteration; the loop walks groups, G = K / 32 of them. STAGES > 1:
    the loop's loads software-pipelined, STAGES - 1 chunks ahead (Triton copies them to shared
    memory asynchronously): a program's chunk alone is too few bytes in flight to cover the
    DRAM's latency when all programs are resident at once, as at batch 1 they are."""
    pdl_start(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    if HAS_E:
        rows += tl.load(E_IDX + m).to(tl.int64) * E_ROWS
    dt = X.dtype.element_ty
    xrow = X + m * s_x
    scale = 1.0
    if NORM:
        scale = rms_scale(xrow, K, eps, BLOCK_K)
    rw = R4 * 4
    gg = tl.arange(0, BLOCK_K // 32)
    ee = tl.arange(0, 4)
    jj = tl.arange(0, 8)
    p = 4 * (jj % 4)  # (value j's field's bit: `_word_dot`, `_word_dot6`)
    if QT == 5:
        p = 8 * ((jj // 2) % 2)
    step = ((127 - p) << 23).to(tl.float32, bitcast=True)  # 2**-p
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
    acc_u = acc
    for g0 in tl.range(0, G, BLOCK_K // 32, num_stages=STAGES):
        g = g0 + gg
        mask_g = g < G
        offs_k = (g * 32)[:, None, None] + (ee * 8)[None, :, None] + jj[None, None, :]
        mask_k = mask_g[:, None, None] & (offs_k >= 0)
        x = activations(xrow, NW, offs_k, mask_k, scale, NORM, dt)  # (NG, 4, 8): value (e, j)
        sx = tl.sum(x, axis=2)
        xs = split8(x * step[None, None, :])
        acc = _chunk_dot(acc, W16, W32, rows, rw, mask_n, g, mask_g, xs, sx, F, QT, QH, SM,
                         DW)
        if SILU:  # (the up half: rows N + offs_n)
            acc_u = _chunk_dot(acc_u, W16, W32, rows + N, rw, mask_n, g, mask_g, xs, sx, F,
                               QT, QH, SM, DW)
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
    e = r // 8
    j = r % 8
    q = (tl.load(W32 + row + g * 4 + e, mask=mask, other=0) >> (4 * j)) & 15
    if QT == 4:
        q = q | (((tl.load(W32 + row + QH // 4 + g, mask=mask, other=0) >> (4 * j + e)) & 1)
                 << 4)
    elif QT == 5:
        h = tl.load(W16 + 2 * row + QH // 2 + g * 4 + e, mask=mask, other=0).to(tl.int32)
        q = q | (((h >> (2 * (j % 2) + 8 * ((j // 2) % 2) + 4 - 4 * (j // 4))) & 3) << 4)
    sm = tl.load(W16 + 2 * row + SM // 2 + g, mask=mask, other=0).to(tl.int32)
    dw = tl.load(W32 + row + DW // 4 + g // 8, mask=mask, other=0)
    s_a, s_b = _group_scales(sm, dw, QT)
    if QT == 5:
        return tl.where(e < 2, s_a, s_b) * (q - 32).to(tl.float32)
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
