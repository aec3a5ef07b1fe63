"""`shards.layers.fused_linear`: a fused projection is an `nn.Linear` like the parts it joins,
its sizes included (the prefill kernels' warm-up sizes its buffers by `out_features`; a fused
linear that reported 1 turned the prefill kernels off on every GPU start)."""

from __future__ import annotations

import torch
from layersplit.shards.layers.fused_linear import concat_linears, frozen_linear
from torch import nn


def test_frozen_linear_reports_its_weights_sizes():
    layer = frozen_linear(torch.randn(7, 5), torch.randn(7))
    assert (layer.out_features, layer.in_features) == (7, 5)
    assert "in_features=5, out_features=7" in repr(layer)


def test_concat_linears_equals_its_parts_side_by_side():
    torch.manual_seed(0)
    parts = [nn.Linear(6, n, bias=True) for n in (4, 2, 2)]
    fused = concat_linears(*parts)
    x = torch.randn(3, 6)
    assert (fused.out_features, fused.in_features) == (8, 6)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1),
                               rtol=0, atol=1e-6)


def test_concat_linears_of_parts_with_and_without_biases():
    """A part without a bias adds zeros (latent attention's q_proj has none where its kv_a
    projection has one): the fused output is still the parts' outputs side by side."""
    torch.manual_seed(1)
    for biases in ((False, True), (True, False), (False, False)):
        parts = [nn.Linear(6, n, bias=b) for n, b in zip((4, 3), biases)]
        fused = concat_linears(*parts)
        assert (fused.bias is None) == (not any(biases))
        x = torch.randn(2, 6)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1),
                                   rtol=0, atol=1e-6)
