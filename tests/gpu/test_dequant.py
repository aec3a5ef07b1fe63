"""The Triton dequantizers of kept FP8 and int4 weights (`shards.kernels.dequant`) against the
torch ones they replace in the prefill tiles (`shards.fp8.dequantize_fp8`,
`shards.int4.dequantize_packed`), bit for bit: FP8 with partial scale blocks on both sides and
tiles that start inside the weight; int4 with and without act order, groups of 32 and 128 and
one group; `fp8_matmul` / `int4_matmul` and the kept linears through them against the torch
tiles, and a K-quant `QuantLinear`'s tiles; a tiny model's prefill kept in FP8 and in int4
against the checkpoint dequantized at load.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 and float16 there; bfloat16 on a device, `DTYPES`).
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.fp8 import dequantize_fp8, quantize_fp8
from layersplit.shards.int4 import Int4Weight, dequantize_packed, pack_rows
from layersplit.shards.kernels import fused_kernels_available

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
# (bfloat16 on a device only: the interpreter casts float32 to it by truncation, where the
# compiled kernel rounds to nearest even as torch does)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV != "cpu" else [])


def _fp8(n: int, k: int, block: tuple[int, int], seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 3
    q, s = quantize_fp8(w, block)
    return q.to(DEV), s.to(DEV)


def _int4(n: int, k: int, group: int, act_order: bool, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    rows = k if group == -1 else group
    g = k // rows
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 17, (n, g), generator=gen).to(torch.uint8)  # (GPTQ's 16 too)
    scales = torch.rand(n, g, generator=gen) * 0.1 + 0.01  # (not float16 values: rounds)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // rows)[torch.randperm(k, generator=gen)].to(torch.int32)
    return Int4Weight(pack_rows(q.t()).t().contiguous().to(DEV), zeros.to(DEV), scales.to(DEV),
                      None if g_idx is None else g_idx.to(DEV), rows)


# (outputs, inputs, block): whole blocks; partial blocks on both sides (576 rows of 128 as
# DeepSeek's); blocks narrower than a program's tile; a row narrower than one
FP8_CASES = [(256, 512, (128, 128)), (576, 300, (128, 128)), (40, 70, (16, 32)),
             (9, 1000, (128, 128))]


@pytest.mark.parametrize("n,k,block", FP8_CASES)
def test_fp8_dequant_equals_torch_to_the_bit(n, k, block):
    from layersplit.shards.kernels.dequant import dequantize_fp8_rows

    q, s = _fp8(n, k, block)
    for dtype in DTYPES:
        assert torch.equal(dequantize_fp8_rows(q, s, block, dtype),
                           dequantize_fp8(q, s, block, dtype)), dtype
    bn = block[0]  # (a tile of the prefill path: whole blocks of rows from inside the weight)
    a, b = bn, min(n, 3 * bn)
    if a < n:
        tile = dequantize_fp8_rows(q[a:b], s[a // bn:-(-b // bn)], block, torch.float32)
        assert torch.equal(tile, dequantize_fp8(q, s, block, torch.float32)[a:b])


# (outputs, inputs, group, act order)
INT4_CASES = [(40, 256, 128, False), (24, 96, 32, False), (48, 256, 32, True),
              (16, 512, 128, True), (8, 200, -1, False)]


@pytest.mark.parametrize("n,k,group,act_order", INT4_CASES)
def test_int4_dequant_equals_torch_to_the_bit(n, k, group, act_order):
    from layersplit.shards.kernels.dequant import dequantize_int4_rows

    w = _int4(n, k, group, act_order, seed=n)
    parts = (w.qweight, w.zeros, w.scales, w.g_idx, w.group)
    for dtype in DTYPES:
        assert torch.equal(dequantize_int4_rows(*parts, dtype),
                           dequantize_packed(*parts, dtype)), dtype
    a, b = 3, n - 5  # (a tile of rows from inside the weight)
    tile = dequantize_int4_rows(w.qweight[a:b], w.zeros[a:b], w.scales[a:b], w.g_idx, w.group,
                                torch.float32)
    assert torch.equal(tile, dequantize_packed(*parts, torch.float32)[a:b])


def test_dequant_refuses_bad_input():
    from layersplit.shards.kernels.dequant import dequantize_fp8_rows, dequantize_int4_rows

    q, s = _fp8(40, 70, (16, 32))
    with pytest.raises(ValueError, match="float32 scales"):
        dequantize_fp8_rows(q, s[:1], (16, 32), torch.float32)
    w = _int4(8, 64, 32, False)
    with pytest.raises(ValueError, match="dequantize_int4_rows"):
        dequantize_int4_rows(w.qweight, w.zeros[:, :1], w.scales, None, 32, torch.float32)


def test_matmul_tiles_through_kernels_equal_torch_tiles():
    """`fp8_matmul` / `int4_matmul` with the kernels (tiles of partial scale blocks) against
    their torch tiles: the same weights, so the same products (float32)."""
    from layersplit.shards.layers.fp8_linear import fp8_matmul
    from layersplit.shards.layers.int4_linear import int4_matmul

    gen = torch.Generator().manual_seed(1)
    q, s = _fp8(40, 70, (16, 32))
    x = torch.randn(2, 20, 70, generator=gen).to(DEV)
    bias = torch.randn(40, generator=gen).to(DEV)
    want = fp8_matmul(x, q, s, (16, 32), bias, tile_elements=16 * 70)
    got = fp8_matmul(x, q, s, (16, 32), bias, tile_elements=16 * 70, kernels=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    w = _int4(24, 96, 32, True)
    x = torch.randn(20, 96, generator=gen).to(DEV)
    want = int4_matmul(x, w, tile_elements=8 * 96)
    torch.testing.assert_close(int4_matmul(x, w, tile_elements=8 * 96, kernels=True), want,
                               rtol=0, atol=0)


def test_kept_linears_take_the_kernels_above_the_gemv_rows():
    """`Fp8Linear` / `Int4Linear` on a step of more rows than their GEMV takes: the tiles of
    the Triton dequantizers (`kernels` decided at the first call), equal to their torch
    tiles'."""
    from layersplit.shards.layers.fp8_linear import Fp8Linear
    from layersplit.shards.layers.int4_linear import Int4Linear

    gen = torch.Generator().manual_seed(2)
    q, s = _fp8(40, 70, (16, 32))
    for lin in (Fp8Linear(q, s, (16, 32)), Int4Linear(_int4(24, 96, 32, False))):
        x = torch.randn(20, lin.in_features, generator=gen).to(DEV)
        got = lin(x)
        assert lin.kernels
        lin.kernels = False
        torch.testing.assert_close(got, lin(x), rtol=0, atol=0)


@pytest.mark.parametrize("planar", [False, True])
def test_kquant_linear_tiles_above_the_gemv_rows(planar):
    """A `QuantLinear` (Q4_K, stored blocks or planar rows) on a step of more rows than its GEMV
    takes: one tile of the kernels' size, and tiles of 8 rows, each the matmul by the weight the
    Triton dequantizer gives whole."""
    import numpy as np
    from layersplit.shards.kernels.quant_gemv import dequantize
    from layersplit.shards.layers.quant_linear import QuantLinear, quant_matmul
    from layersplit.shards.quant_blocks import random_blocks, to_planar

    blocks = torch.from_numpy(random_blocks(40, 512, "Q4_K", np.random.default_rng(4)))
    blocks = (to_planar(blocks, "Q4_K") if planar else blocks).to(DEV)
    w = dequantize(blocks, "Q4_K", 512, torch.float32, planar=planar)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(4)).to(DEV)
    want = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(QuantLinear(blocks, "Q4_K", 512, planar=planar)(x), want,
                               rtol=0, atol=0)
    got = quant_matmul(x, blocks, "Q4_K", 512, tile_elements=8 * 512, kernels=True,
                       planar=planar)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def _prefill_logits(path, weights: str) -> torch.Tensor:
    """The last position's logits of a 24-token prefill (the layers' projections: more rows than
    the GEMVs take, so the tiles) of a tiny model, float32, one range on DEV."""
    from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
    from layersplit.shards.executor import RangeExecutor

    r = load_layer_range(open_checkpoint(path), 0, 2, torch.float32, DEV, weights)
    ex = RangeExecutor(r, 64, device=DEV)
    ex.before_step(0, 0, None)
    tokens = torch.randint(0, 100, (24,), generator=torch.Generator().manual_seed(3))
    return ex.run(tokens.to(DEV), 0)


@pytest.mark.parametrize("kind", ["fp8", "gptq"])
def test_model_prefill_kept_equals_dequantized(tmp_path, kind):
    """A tiny Llama kept in FP8 (blocks of 16 x 32) or GPTQ int4 (act order), its prefill
    through the Triton dequantizers' tiles, against the same checkpoint dequantized at load."""
    from layersplit.shards.tiny import write_tiny_checkpoint

    from tests.helpers import write_fp8, write_int4

    dense = write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2)
    path = write_fp8(dense, tmp_path / kind) if kind == "fp8" else \
        write_int4(dense, tmp_path / kind, "gptq", act_order=True)
    want = _prefill_logits(path, "dequantize")
    got = _prefill_logits(path, "quantized")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
