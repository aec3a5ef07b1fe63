"""Linear layers whose weights stay in int4 (`weight_format = "quantized"` on a GPTQ or AWQ
checkpoint, `shards.int4`): the layout both are repacked into at load (`int4.Int4Weight`: int32
words of eight values along K, rows = outputs; a uint8 zero and a float32 scale per row and
group; act order's `g_idx` where it is not groups of consecutive rows), about 0.54 byte a weight
with groups of 128 on the device where the dequantized weight takes two (bfloat16).

`Int4Linear` stands where an `nn.Linear` stood (`quant_load.install_kept`), as `layers.
fp8_linear.Fp8Linear` does:
- where the Triton kernels run (`kernels.fused_kernels_available`), steps of up to
  `kernels.int4_gemv.MAX_ROWS` rows run the GEMV that dequantizes in registers
  (`kernels.int4_gemv`), which the fused decode step also takes with its norm and epilogues
  (`quant_linear.module_gemv`);
- everywhere else (CPU; prefill chunks), `int4_matmul`: the weight dequantized a tile of rows
  at a time to the activations' dtype (the values of dequantizing at load, `int4.
  dequantize_packed`, to the bit; where the kernels run, by one Triton launch a tile, `kernels.
  dequant`, and tiles of `tiled.KERNEL_TILE_ELEMENTS` values), then `F.linear` (`layers.tiled`).
"""

from __future__ import annotations

import torch
from layersplit.shards.int4 import Int4Weight, dequantize_packed, kept_layout_error
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.tiled import gemv_or_none, tile_rows, tiled_linear
from torch import nn


def int4_matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None,
                tile_elements: int | None = None, kernels: bool = False) -> torch.Tensor:
    """F.linear of `x` (..., k) by the int4 weight `w`, dequantized to x's dtype a tile of
    rows at a time (`kernels`: by the Triton dequantizer, `kernels.dequant.
    dequantize_int4_rows`; else by torch ops), `tile_elements` values a tile at most (default
    `tiled.tile_rows`')."""
    n, k = w.qweight.shape[0], w.qweight.shape[1] * 8
    dequantize = dequantize_packed
    if kernels:
        from layersplit.shards.kernels.dequant import dequantize_int4_rows as dequantize

    def rows(a: int, b: int) -> torch.Tensor:
        return dequantize(w.qweight[a:b], w.zeros[a:b], w.scales[a:b], w.g_idx, w.group,
                          x.dtype)

    return tiled_linear(x, n, tile_rows(k, kernels, 1, tile_elements), rows, bias)


class Int4Linear(nn.Module):
    """y = x W^T + b with W (out_features, in_features) kept as int4 values with a zero and a
    scale per group of inputs (`int4.Int4Weight`)."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        k = w.qweight.shape[-1] * 8
        wrong = kept_layout_error(w.qweight, w.zeros, w.scales, w.group, w.g_idx, k)
        if wrong:
            raise ValueError(f"Int4Linear: {wrong}")
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("zeros", w.zeros)
        self.register_buffer("scales", w.scales)
        self.register_buffer("g_idx", w.g_idx)
        self.group = w.group
        self.out_features, self.in_features = w.qweight.shape[0], k
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernels: bool | None = None  # the Triton kernels: decided at the first call

    @property
    def weight4(self) -> Int4Weight:
        """The kept weight (its buffers, wherever the module now is)."""
        return Int4Weight(self.qweight, self.zeros, self.scales, self.g_idx, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            self.kernels = fused_kernels_available(x.device)
        if self.kernels:
            from layersplit.shards.kernels.int4_gemv import MAX_ROWS

            y = gemv_or_none(self, x, MAX_ROWS)
            if y is not None:
                return y
        return int4_matmul(x, self.weight4, self.bias, kernels=self.kernels)

    def gemv(self, x: torch.Tensor, **options) -> torch.Tensor:
        """`kernels.int4_gemv.int4_gemv` of rows `x` by this weight and bias, with its
        `options` (norm, residual, gate_up, out, out_dtype)."""
        from layersplit.shards.kernels.int4_gemv import int4_gemv

        return int4_gemv(x, self.qweight, self.zeros, self.scales, self.group, self.g_idx,
                         self.bias, **options)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"group={self.group}, act_order={self.g_idx is not None}, "
                f"bias={self.bias is not None}")


def concat_int4(parts: list[Int4Linear]) -> Int4Linear | None:
    """One `Int4Linear` of `parts` side by side (q/k/v, gate/up): None where they cannot be
    (other groups or act orders, some biased and some not)."""
    first = parts[0]

    def same_order(p: Int4Linear) -> bool:
        if p.g_idx is None or first.g_idx is None:
            return p.g_idx is None and first.g_idx is None
        return torch.equal(p.g_idx, first.g_idx)

    if not all(isinstance(p, Int4Linear) and p.in_features == first.in_features and
               p.group == first.group and same_order(p) for p in parts):
        return None
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    return Int4Linear(Int4Weight(torch.cat([p.qweight for p in parts]),
                                 torch.cat([p.zeros for p in parts]),
                                 torch.cat([p.scales for p in parts]), first.g_idx, first.group),
                      None if biases[0] is None else torch.cat(biases))
