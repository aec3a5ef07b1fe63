"""The decode step after attention of a mixture-of-experts layer (`shards.fused`): o_proj,
residual, norm, router, the selected experts as grouped GEMMs (`grouped_experts`: no host sync,
so the step stays inside its CUDA graph; the rows of a verify or batched step are grouped by
expert) and the shared expert where the family has one. Same math as `RoutedMoE`; the CPU tests
compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.layers.routed_moe import grouped_experts, route


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def post_attention_moe(h, attn, o_w, ln2_w, router_w, gate_up, down, sh_gu, sh_down, sh_gate,
                       eps: float, top_k: int, norm: bool, float_weights: bool):
    """h + o(attn), then + the sparse MLP of its norm. `sh_*`: the shared expert's fused
    gate/up and down weights and its sigmoid gate (None without one)."""
    h = h + F.linear(attn, o_w)
    x = _rms_norm(h, ln2_w, eps)
    w, idx = route(x, router_w, top_k, norm, float_weights)
    out = grouped_experts(x, w, idx, gate_up, down)
    if sh_gu is not None:
        g, u = F.linear(x, sh_gu).chunk(2, dim=-1)
        out = out + torch.sigmoid(F.linear(x, sh_gate)) * F.linear(F.silu(g) * u, sh_down)
    return h + out


def post_attention_moe_batch(*args):
    """`post_attention_moe` under its own code object, for batched steps (`shards.fused`)."""
    return post_attention_moe(*args)


def moe_args(layer) -> tuple:
    """The weights and settings of `layer`'s fused sparse MLP, in `post_attention_moe`'s
    order after `attn`."""
    a, m = layer.self_attn, layer.mlp
    sh = m.shared_expert
    return (a.o_proj.weight, layer.post_attention_layernorm.weight, m.gate.weight,
            m.experts.gate_up_proj, m.experts.down_proj,
            None if sh is None else sh.gate_up_proj.weight,
            None if sh is None else sh.down_proj.weight,
            None if sh is None else m.shared_expert_gate.weight,
            layer.input_layernorm.eps, m.top_k, m.norm_topk_prob, m.float_weights)
