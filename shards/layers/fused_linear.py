"""The holder of a fused projection (GPU decode steps: one GEMV where a checkpoint has two to
four): an `nn.Linear` built around given tensors, with no init and no gradient."""

from __future__ import annotations

import torch
from layersplit.shards.layers.quant_linear import concat_quant, is_quantized
from torch import nn


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An `nn.Linear` holding `weight` (out, in) and `bias` as they are."""
    layer = nn.Linear(1, 1, bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.out_features, layer.in_features = weight.shape  # (read by the kernels' warm-up)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def concat_linears(*parts: nn.Linear) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side (biases where they have
    them); parts kept quantized: `quant_linear.concat_quant`."""
    if any(is_quantized(p) for p in parts):
        return concat_quant(list(parts))
    # (a part without a bias adds zeros: latent attention's q_proj has none, its kv_a may)
    bias = None if all(p.bias is None for p in parts) else torch.cat(
        [p.weight.new_zeros(p.weight.shape[0]) if p.bias is None else p.bias for p in parts])
    return frozen_linear(torch.cat([p.weight for p in parts]), bias)
