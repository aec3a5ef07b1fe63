"""Triton dequantizers of the kept FP8 and int4 weights (`layers.fp8_linear`,
`layers.int4_linear`): rows of a weight to the activations' dtype in one launch, the tiles of
their prefill path (`layers.tiled`), where the torch ops of `fp8.dequantize_fp8` and
`int4.dequantize_packed` are six to ten kernels a tile and float32 temporaries of several times
its size.

Each program writes a (BLOCK_N, BLOCK_K) tile of the result with the torch functions'
arithmetic: the float32 product (FP8: the e4m3 value in float32 times its block's scale; int4:
the integer q - zero in float32 times its group's scale), then one rounding to the dtype
(round to nearest even, as torch's cast), so the values equal theirs to the bit
(`tests/gpu/test_dequant.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.int4 import kept_layout_error

BLOCK_N = 16  # rows a program
BLOCK_K = 256  # columns a program
NUM_WARPS = 4


@triton.jit
def _fp8_dequant(W, s_w, S, s_s, Y, s_y, N, K, BN, BK,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(W + rows[:, None] * s_w + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(S + (rows // BN)[:, None] * s_s + (offs_k // BK)[None, :], mask=mask, other=0.0)
    y = w.to(tl.float32) * s
    tl.store(Y + rows[:, None] * s_y + offs_k[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant(Q, Z, S, G_IDX, Y, N, K, G, GROUP, HAS_G_IDX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)
    mask_k = offs_k < K
    mask = (offs_n < N)[:, None] & mask_k[None, :]
    words = tl.load(Q + rows[:, None] * (K // 8) + (offs_k // 8)[None, :], mask=mask, other=0)
    q = (words >> ((offs_k % 8) * 4)[None, :]) & 15
    if HAS_G_IDX:
        groups = tl.load(G_IDX + offs_k, mask=mask_k, other=0)
    else:
        groups = offs_k // GROUP
    at = rows[:, None] * G + groups[None, :]
    z = tl.load(Z + at, mask=mask, other=0).to(tl.int32)
    s = tl.load(S + at, mask=mask, other=0.0)
    y = (q - z).to(tl.float32) * s
    tl.store(Y + rows[:, None] * K + offs_k[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _grid(n: int, k: int) -> tuple[int, int]:
    return triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        dtype: torch.dtype) -> torch.Tensor:
    """`fp8.dequantize_fp8` of a (rows, cols) float8 e4m3 `weight` (rows of unit column stride)
    and its float32 block `scale` (a partial last block on either side takes its own), in one
    launch."""
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or \
            scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.stride(1) != 1:
        raise ValueError(f"dequantize_fp8_rows: weight {tuple(weight.shape)} {weight.dtype} and "
                         f"scale {tuple(scale.shape)} {scale.dtype} are not float8 e4m3 rows "
                         f"and float32 scales {want} of {block} blocks")
    y = torch.empty(n, k, dtype=dtype, device=weight.device)
    if y.numel():
        _fp8_dequant[_grid(n, k)](weight, weight.stride(0), scale, scale.stride(0), y,
                                  y.stride(0), n, k, bn, bk, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                  num_warps=NUM_WARPS)
    return y


def dequantize_int4_rows(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         g_idx: torch.Tensor | None, group: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """`int4.dequantize_packed` of rows of the kept int4 layout (`int4.Int4Weight`'s parts,
    those rows': contiguous), in one launch."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    wrong = kept_layout_error(qweight, zeros, scales, group, g_idx, k)
    if wrong:
        raise ValueError(f"dequantize_int4_rows: {wrong}")
    y = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if y.numel():
        _int4_dequant[_grid(n, k)](qweight, zeros, scales, qweight if g_idx is None else g_idx,
                                   y, n, k, scales.shape[1], group,
                                   HAS_G_IDX=g_idx is not None, BLOCK_N=BLOCK_N,
                                   BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return y
