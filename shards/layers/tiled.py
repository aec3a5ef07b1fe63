"""F.linear by a weight kept quantized, dequantized a tile of output rows at a time: the prefill
path of the kept layers (`layers.fp8_linear`, `layers.int4_linear`, `layers.quant_linear`),
whose dequantized copy alive at once is one tile; and the choice between it and their GEMV
(`gemv_or_none`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The most weight values a tile dequantizes at once.
# - By torch ops (CPU; GPUs without the kernels): their float32 temporaries are several times
#   the tile, so it stays small (16 MB of float32 values).
TILE_ELEMENTS = 1 << 22
# - By a Triton kernel (one launch a tile, writing the activations' dtype, no temporaries): the
#   tile alive is 64 MB in bfloat16, and a layer of the Llama-8B shape is 1 to 4 tiles a
#   projection (8 a layer, against 54 at `TILE_ELEMENTS`), so a 512-token prefill is a few
#   hundred launches; at fewer values the launches and the GEMMs' short shapes cost the time.
KERNEL_TILE_ELEMENTS = 1 << 25


def tile_rows(k: int, kernels: bool, align: int = 1, tile_elements: int | None = None) -> int:
    """Rows of a weight of `k` inputs a tile takes: `tile_elements` values at most (default
    `KERNEL_TILE_ELEMENTS` where the Triton dequantizers run, else `TILE_ELEMENTS`), a
    multiple of `align` (FP8's scale blocks of rows), `align` at least."""
    if tile_elements is None:
        tile_elements = KERNEL_TILE_ELEMENTS if kernels else TILE_ELEMENTS
    return max(align, tile_elements // max(k, 1) // align * align)


def tiled_linear(x: torch.Tensor, n: int, tile: int,
                 rows: Callable[[int, int], torch.Tensor],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of `x` (..., k) by the (n, k) weight whose rows a..b `rows(a, b)` dequantizes
    (to x's dtype), `tile` rows at a time (one call where `tile` >= n: the very F.linear of
    the whole weight)."""
    if tile >= n:
        return F.linear(x, rows(0, n), bias)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, tile):
        n1 = min(n0 + tile, n)
        out[..., n0:n1] = F.linear(x, rows(n0, n1), None if bias is None else bias[n0:n1])
    return out


def gemv_or_none(module, x: torch.Tensor, max_rows: int) -> torch.Tensor | None:
    """`module.gemv` of the rows of `x` (..., in_features) where a step has 1 to `max_rows` of
    them, shaped as `x` (..., out_features); None for the tiles' path: more rows, or none (a
    GEMV refuses an empty step)."""
    rows = x.numel() // module.in_features
    if not 0 < rows <= max_rows:
        return None
    y = module.gemv(x.reshape(rows, module.in_features).contiguous())
    return y.reshape(*x.shape[:-1], module.out_features)
