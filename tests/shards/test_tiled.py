"""The tiles of the kept layers' prefill path (`shards.layers.tiled`): rows a tile takes, by who
dequantizes it, and F.linear through tiles equal to F.linear of the whole weight (within float32
summation order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.layers.tiled import (
    KERNEL_TILE_ELEMENTS,
    TILE_ELEMENTS,
    tile_rows,
    tiled_linear,
)


def test_tile_rows_by_dequantizer_and_alignment():
    # the Llama-8B shape's gate/up (28672 x 4096) and down (4096 x 14336)
    assert tile_rows(4096, kernels=False) == TILE_ELEMENTS // 4096 == 1024
    assert tile_rows(4096, kernels=True) == KERNEL_TILE_ELEMENTS // 4096 == 8192
    assert tile_rows(14336, kernels=False, align=128) == 256  # (whole scale blocks of rows)
    assert tile_rows(14336, kernels=True, align=128) == 2304
    assert tile_rows(1 << 30, kernels=True, align=16) == 16  # (one block at the least)
    assert tile_rows(100, kernels=True, tile_elements=1000) == 10


def test_tiled_linear_equals_linear():
    gen = torch.Generator().manual_seed(0)
    w, x, b = (torch.randn(*s, generator=gen) for s in ((37, 24), (3, 5, 24), (37,)))
    for tile in (1, 8, 37, 64):
        got = tiled_linear(x, 37, tile, lambda a, c: w[a:c], b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=1e-5)
