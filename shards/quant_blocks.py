"""GGUF quantized blocks kept as stored: their layouts, and their dequantization in torch.

A quantized matrix (N, K) is kept as uint8 rows (N, K / block * type_size): each row is whole
blocks of K's direction, as the file stores it, so rows can be sliced, permuted, concatenated
and gathered (an embedding lookup) without touching the blocks. `dequantize_rows` turns rows
back into float32 with the same float32 operations, in the same order, as `gguf.quants.
dequantize` (the reference the tests hold it to, bit for bit).

Kept quantized: Q8_0, Q4_0, Q4_1 (32-value blocks) and Q4_K, Q5_K, Q6_K (256-value super
blocks), which make up the Q4_0/Q4_1/Q8_0 files and the Q4_K_M/Q5_K_M mixes.

Where the GPU kernels read them, the K types' rows are repacked at load into a planar row
layout (`to_planar`), for the kernels of `kernels.quant_planar`; still one self-contained row
per matrix row (slices, concatenation and gathers work on it as on the stored rows). A row of
K values, G = K / 32 groups of 32 values (sub-blocks), S = K / 256 super blocks:

- quants: G runs of 16 bytes, the low 4 bits of the group's values: four int32 words, value
  r = 8e + j of the group in word e, bits 4j .. 4j + 3 (value (e, j); so the nibbles are in
  the values' order, two a byte, low nibble first, as int4 words hold theirs);
- high bits: Q5_K one int32 word a group, value (e, j)'s fifth bit at bit 4j + e; Q6_K four
  int16 halves a group, half e holding the two high bits of value (e, j) at bits h(j) .. + 1,
  h(j) = 2 (j % 2) + 8 ((j // 2) % 2) + 4 (1 - j // 4), for j = 0..7: 4, 6, 12, 14, 0, 2, 8,
  10 (so that two shifts and an OR of a half put those of values 0, 2, 4, 6 at bits 8b + 4,
  b = 0..3, above their nibbles taken a byte apart, and two more those of 1, 3, 5, 7);
- scales: two bytes a group: Q4_K / Q5_K its six-bit scale and min; Q6_K the int8 scales of
  its values 0..15 and 16..31;
- one int32 word a super block: Q4_K / Q5_K d | dmin << 16, Q6_K d (float16 bits);
- zero bytes to a multiple of 16.

Every section starts at a multiple of 16 bytes (K is whole super blocks), so the quants are
read in 16-byte vectors. Bits per value: Q4_K 4.625 (stored: 4.5), Q5_K 5.625 (5.5), Q6_K
6.625 (6.5625), plus the row's padding. The values are the stored ones: only bytes move (the
scales' six-bit fields unpacked), so a kernel computes gguf's float32 expressions from them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, slots=True)
class BlockType:
    name: str
    block: int  # values a block holds
    size: int  # bytes a block takes

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of `k` values (`k` a whole number of blocks)."""
        if k % self.block:
            raise ValueError(f"{self.name}: a row of {k} values is not whole blocks of "
                             f"{self.block}")
        return k // self.block * self.size


KEPT_TYPES = {t.name: t for t in (
    BlockType("Q8_0", 32, 34), BlockType("Q4_0", 32, 18), BlockType("Q4_1", 32, 20),
    BlockType("Q4_K", 256, 144), BlockType("Q5_K", 256, 176), BlockType("Q6_K", 256, 210),
)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes (..., 2) as float16 values (...,) widened to float32."""
    import torch
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _shifts(values: list[int], device: torch.device) -> torch.Tensor:
    import torch
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes (..., g * width) as their low nibbles then high nibbles per group of `width`:
    (..., g * 2 * width) values 0..15 (ggml's order). (One pass over the bytes for each half,
    no broadcast intermediate.)"""
    import torch
    q = qs.reshape(*qs.shape[:-1], -1, 1, width)
    return torch.cat([q & 0x0F, q >> 4], dim=-2).reshape(*qs.shape[:-1], -1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    import torch
    d = _f16(b[..., :2])
    x = b[..., 2:].contiguous().view(torch.int8).float()
    return x * d[..., None]


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    import torch
    d = _f16(b[..., :2])
    q = (_nibbles(b[..., 2:], 16).to(torch.int8) - 8).float()
    return d[..., None] * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 4:], 16).float()
    return q.mul_(d[..., None]).add_(m[..., None])  # (d * q + m, in place)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K super block: 8 six-bit scales and 8 six-bit mins."""
    import torch
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    scale = (d[..., None] * sc.float())[..., None]  # (..., 8, 1)
    off = (dmin[..., None] * mn.float())[..., None]
    q = _nibbles(b[..., 16:], 32).reshape(*b.shape[:-1], 8, 32).float()
    return (scale * q - off).reshape(*b.shape[:-1], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    scale = (d[..., None] * sc.float())[..., None]
    off = (dmin[..., None] * mn.float())[..., None]
    lo = _nibbles(b[..., 48:], 32).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32) >> _shifts(list(range(8)), b.device).view(
        8, 1)
    q = (lo | ((qh & 0x01) << 4)).float()
    return (scale * q - off).reshape(*b.shape[:-1], 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    import torch
    lead = b.shape[:-1]
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210])
    scale = (d[..., None] * scales).reshape(*lead, 16, 1)
    lo = _nibbles(b[..., :128], 64).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> _shifts([0, 2, 4, 6], b.device).view(4, 1)
    hi = (qh & 0x03).reshape(*lead, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(*lead, 16, 16).float()
    return (scale * q).reshape(*lead, 256)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k,
            "Q6_K": _q6_k}


def dequantize_rows(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 rows (..., row_bytes) of `qtype` blocks -> float32 (..., values)."""
    t = KEPT_TYPES[qtype]
    lead = rows.shape[:-1]
    blocks = rows.reshape(*lead, rows.shape[-1] // t.size, t.size)
    return _DEQUANT[qtype](blocks).reshape(*lead, blocks.shape[-2] * t.block)  # (0 rows too)


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator,
                  scale: float = 0.02) -> np.ndarray:
    """Random `qtype` blocks of a (rows, cols) matrix (uint8 (rows, row_bytes)), values of
    about `scale`: random quantized values with their scales set, for test and benchmark files
    (gguf-py cannot quantize to the K types, and is slow on large matrices)."""
    t = KEPT_TYPES[qtype]
    n = rows * (cols // t.block)
    b = rng.integers(0, 256, size=(n, t.size), dtype=np.uint8)

    def f16(v: float) -> np.ndarray:
        return np.full((n, 1), v, dtype=np.float16).view(np.uint8)

    if qtype == "Q8_0":  # d, 32 int8
        b[:, 0:2] = f16(scale / 64)
    elif qtype == "Q4_0":  # d, nibbles - 8
        b[:, 0:2] = f16(scale / 4)
    elif qtype == "Q4_1":  # d, m, nibbles
        b[:, 0:2] = f16(scale / 4)
        b[:, 2:4] = f16(-scale * 2)
    elif qtype == "Q6_K":  # int8 scales of 16 values, then d
        b[:, 192:208] = rng.integers(-40, 40, size=(n, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = f16(scale / 32 / 20)
    else:  # Q4_K / Q5_K: d, dmin, then the packed six-bit scales/mins (random bits are valid)
        b[:, 0:2] = f16(scale / 8 / 32)
        b[:, 2:4] = f16(scale / 32)
    return b.reshape(rows, t.row_bytes(cols))


PLANAR_TYPES = ("Q4_K", "Q5_K", "Q6_K")
_HIGH_BITS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}


def planar_sections(k: int, qtype: str) -> tuple[int, int, int, int]:
    """Byte offsets of the high bits, the scales and the super blocks' words in a planar row of
    `k` values (`to_planar`), and the row's bytes."""
    KEPT_TYPES[qtype].row_bytes(k)  # (checks k is whole super blocks)
    high = k // 2
    scales = high + k * _HIGH_BITS[qtype] // 8
    words = scales + k // 16
    return high, scales, words, -(-(words + k // 64) // 16) * 16


def _u8_groups(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Values (..., n) as bit fields of `bits` bits packed in n * bits / 8 bytes, value i at
    bit i * bits (little-endian)."""
    import torch
    per = 8 // bits
    v = v.reshape(*v.shape[:-1], -1, per).to(torch.int32)
    out = torch.zeros(v.shape[:-1], dtype=torch.int32, device=v.device)
    for i in range(per):
        out |= v[..., i] << (bits * i)
    return out.to(torch.uint8)


def to_planar(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 rows (N, row_bytes) of `qtype` (one of `PLANAR_TYPES`) blocks as planar rows
    (N, `planar_sections(k)[3]`): the layout in the module's docstring."""
    import torch
    t = KEPT_TYPES[qtype]
    n = rows.shape[0]
    s = rows.shape[1] // t.size
    k = s * 256
    b = rows.reshape(n, s, t.size)
    if qtype == "Q6_K":
        lo = _nibbles(b[..., :128], 64).reshape(n, s, 8, 32)
        qh = b[..., 128:192].reshape(n, s, 2, 1, 32) >> _shifts([0, 2, 4, 6], b.device).view(
            4, 1)
        q = lo | ((qh & 0x03).reshape(n, s, 8, 32) << 4)
        scales = b[..., 192:208]
        word = torch.cat([b[..., 208:210], torch.zeros_like(b[..., 208:210])], dim=-1)
    else:
        word = b[..., 0:4]
        sc, mn = _k_scales(b[..., 4:16])
        scales = torch.stack([sc, mn], dim=-1)
        if qtype == "Q4_K":
            q = _nibbles(b[..., 16:], 32).reshape(n, s, 8, 32)
        else:
            lo = _nibbles(b[..., 48:], 32).reshape(n, s, 8, 32)
            qh = b[..., 16:48].reshape(n, s, 1, 32) >> _shifts(list(range(8)), b.device).view(
                8, 1)
            q = lo | ((qh & 0x01) << 4)
    q = q.reshape(n, s * 8, 4, 8)  # (row, group, e, j): value r = 8e + j of the group
    low = q & 0x0F
    quants = (low[..., 0::2] | (low[..., 1::2] << 4)).reshape(n, -1)  # word e: nibble j at 4j
    parts = [quants]
    if qtype == "Q5_K":  # bit 4j + e of the group's word: the fifth bit of value (e, j)
        hi = (q >> 4).transpose(2, 3).reshape(n, s * 8, 32)  # (fields in bit order)
        parts.append(_u8_groups(hi & 1, 1).reshape(n, -1))
    elif qtype == "Q6_K":  # half e: value (e, j)'s two high bits, fields in bit order
        hi = (q >> 4)[..., [4, 5, 0, 1, 6, 7, 2, 3]]  # (row, group, e, field)
        parts.append(_u8_groups(hi, 2).reshape(n, -1))
    parts += [scales.reshape(n, -1), word.reshape(n, -1)]
    out = torch.zeros(n, planar_sections(k, qtype)[3], dtype=torch.uint8, device=rows.device)
    torch.cat(parts, dim=1, out=out[:, :sum(p.shape[1] for p in parts)])
    return out
