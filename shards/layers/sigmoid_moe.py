"""The mixture of experts of DeepSeek-V3 (and Kimi K2): grouped sigmoid routing ("noaux_tc")
over SwiGLU experts, plus shared experts that every token runs.

Shapes: n = tokens, H = hidden, E = experts, k = experts per token, G = expert groups.
The experts themselves run as every MoE family's (`shards.layers.routed_moe.Experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.routed_moe import Experts
from layersplit.shards.model_config import ModelConfig
from torch import nn


def route_grouped(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                  n_group: int, topk_group: int, norm: bool, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) float32, expert ids (n, k)) as transformers' `DeepseekV3TopkRouter`:
    sigmoid of the float32 router logits; `bias` (the correction bias) added for choosing
    only; each group scored by the sum of its top 2; the experts of the best `topk_group`
    groups compete for the top k; their unbiased scores, renormalised when `norm`, times
    `scaling`."""
    scores = torch.sigmoid(F.linear(x.float(), router_w.float()))  # (n, E)
    choice = scores + bias.float()
    n, e = choice.shape
    if n_group > 1:
        groups = choice.view(n, n_group, e // n_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_group, dim=-1)[1]  # (n, kg)
        keep = torch.zeros(n, n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, best, True)
        choice = choice.masked_fill(~keep[:, :, None].expand(n, n_group, e // n_group)
                                    .reshape(n, e), float("-inf"))
    idx = choice.topk(top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, idx


class GroupRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))


class SharedExpertsMoE(nn.Module):
    """Router + routed experts + ungated shared experts; names as transformers'
    `DeepseekV3MoE` (`gate`, `experts`, `shared_experts`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        r = cfg.group_routing
        assert r is not None
        self.top_k, self.norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = (r.n_group, r.topk_group,
                                                       r.routed_scaling_factor)
        self.gate = GroupRouter(cfg)
        self.experts = Experts(cfg)
        s = cfg.shared_expert_intermediate_size
        self.shared_experts = MLP(cfg, s) if s else None

    def fuse(self) -> None:
        self.experts.fuse()
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = route_grouped(x, self.gate.weight, self.gate.e_score_correction_bias,
                               self.top_k, self.n_group, self.topk_group, self.norm,
                               self.scaling)
        out = self.experts(x, w, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
