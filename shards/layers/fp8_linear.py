"""Linear layers whose weights stay in FP8 (`weight_format = "quantized"` on an FP8 checkpoint,
`shards.fp8`): float8 e4m3 values and a float32 scale per block of `block` (rows, columns), one
byte a weight on the device where the dequantized weight takes two (bfloat16).

`Fp8Linear` stands where an `nn.Linear` stood (`quant_load.install_kept`):
- where the Triton kernels run and the GPU converts FP8 (`kernels.fp8_kernels_available`: CUDA,
  compute capability 8.9 and later), steps of up to
  `kernels.fp8_gemv.MAX_ROWS` rows run the GEMV that scales in registers (`kernels.fp8_gemv`),
  which the fused decode step also takes with its norm and epilogues (`quant_linear.module_gemv`);
- everywhere else (CPU; prefill chunks), `fp8_matmul`: the weight dequantized a tile of whole
  scale blocks of rows at a time to the activations' dtype (the values of dequantizing at load,
  `fp8.dequantize_fp8`, to the bit; where the FP8 kernels run, by one Triton launch a tile,
  `kernels.dequant`, and tiles of `tiled.KERNEL_TILE_ELEMENTS` values), then `F.linear`, so the
  dequantized copy alive at once is one tile (`layers.tiled`).
"""

from __future__ import annotations

import torch
from layersplit.shards.fp8 import dequantize_fp8, scale_shape
from layersplit.shards.kernels import fp8_kernels_available
from layersplit.shards.layers.tiled import gemv_or_none, tile_rows, tiled_linear
from torch import nn


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None,
               tile_elements: int | None = None, kernels: bool = False) -> torch.Tensor:
    """F.linear of `x` (..., k) by the FP8 (n, k) `weight` and its block `scale`, dequantized
    to x's dtype a tile of whole scale blocks of rows at a time (`kernels`: by the Triton
    dequantizer, `kernels.dequant.dequantize_fp8_rows`; else by torch ops), `tile_elements`
    values a tile at most (default `tiled.tile_rows`')."""
    n, k = weight.shape
    bn = block[0]
    tile = tile_rows(k, kernels, bn, tile_elements)
    dequantize = dequantize_fp8
    if kernels:
        from layersplit.shards.kernels.dequant import dequantize_fp8_rows as dequantize

    def rows(a: int, b: int) -> torch.Tensor:
        return dequantize(weight[a:b], scale[a // bn:-(-b // bn)], block, x.dtype)

    return tiled_linear(x, n, tile, rows, bias)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W (out_features, in_features) kept as float8 e4m3 values and float32
    scales, one per `block` of rows x columns."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or \
                tuple(scale.shape) != scale_shape(tuple(weight.shape), block):
            raise ValueError(f"Fp8Linear: a float8 e4m3 (rows, cols) weight and its scales of "
                             f"{block} blocks, got {tuple(weight.shape)} {weight.dtype} and "
                             f"{tuple(scale.shape)}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())
        self.block = (int(block[0]), int(block[1]))
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernels: bool | None = None  # the Triton kernels: decided at the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            self.kernels = fp8_kernels_available(x.device)
        if self.kernels:
            from layersplit.shards.kernels.fp8_gemv import MAX_ROWS

            y = gemv_or_none(self, x, MAX_ROWS)
            if y is not None:
                return y
        return fp8_matmul(x, self.weight, self.scale, self.block, self.bias,
                          kernels=self.kernels)

    def gemv(self, x: torch.Tensor, **options) -> torch.Tensor:
        """`kernels.fp8_gemv.fp8_gemv` of rows `x` by this weight and bias, with its
        `options` (norm, residual, gate_up, out, out_dtype)."""
        from layersplit.shards.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x, self.weight, self.scale, self.block, self.bias, **options)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 "
                f"e4m3, block={self.block}, bias={self.bias is not None}")


def concat_fp8(parts: list[Fp8Linear]) -> Fp8Linear | None:
    """One `Fp8Linear` of `parts` side by side (q/k/v, gate/up): None where they cannot be
    (other blocks, a part but the last that is not whole blocks of rows, some biased and some
    not)."""
    first = parts[0]
    if not all(isinstance(p, Fp8Linear) and p.block == first.block and
               p.in_features == first.in_features for p in parts) or \
            any(p.out_features % first.block[0] for p in parts[:-1]):  # (the last may end
        # in a partial block of rows, as a whole weight may)
        return None
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    return Fp8Linear(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]),
                     first.block, None if biases[0] is None else torch.cat(biases))
