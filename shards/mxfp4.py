"""MXFP4 weights (gpt-oss's published experts): 4-bit E2M1 values in blocks of 32 sharing one
power-of-two scale, stored as `NAME_blocks` (.., rows, cols / 32, 16) uint8, two values a byte,
low nibble first, and `NAME_scales` (.., rows, cols / 32) uint8, the exponent + 127. Dequantized
as transformers' `convert_moe_packed_tensors` does, into its layout: (.., cols, rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# the 16 E2M1 values by code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """(E, R, G, 16) blocks and (E, R, G) scales -> (E, G * 32, R) of `dtype`, one expert at a
    time (the code indices of a whole layer would take 16 bytes a weight)."""
    import torch
    e, r, g, b = blocks.shape
    if tuple(scales.shape) != (e, r, g):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales.shape)} for blocks of shape "
                         f"{tuple(blocks.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(e, r, g, 2 * b, dtype=dtype, device=blocks.device)
    for i in range(e):
        blk = blocks[i]
        out[i, ..., 0::2] = lut[(blk & 0x0F).long()]
        out[i, ..., 1::2] = lut[(blk >> 4).long()]
        torch.ldexp(out[i], scales[i].to(torch.int32)[..., None] - 127, out=out[i])
    return out.view(e, r, g * 2 * b).transpose(1, 2).contiguous()
