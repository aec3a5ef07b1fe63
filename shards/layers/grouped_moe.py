"""A mixture of experts routed as DeepSeek-V3 and GLM-4.5 route ("noaux_tc"): sigmoid scores,
a per-expert correction bias that only picks, grouped top-k, plus always-on shared experts.

Shapes: n = tokens, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.routed_moe import Experts
from layersplit.shards.model_config import ModelConfig
from torch import nn


def route_grouped(logits: torch.Tensor, correction: torch.Tensor, top_k: int, groups: int,
                  topk_group: int, norm: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) float32, expert ids (n, k)) from router logits (n, E), as transformers'
    `Glm4MoeTopkRouter`: scores = sigmoid(logits); the corrected scores (+ `correction`) rank
    the E/groups experts of each group by the sum of its 2 best, keep the `topk_group` best
    groups and the top k experts within them; the picks weigh by their uncorrected scores,
    renormalised to sum to 1 when `norm`, times `scale`."""
    n, e = logits.shape
    scores = logits.float().sigmoid()
    chosen = scores + correction.float()
    best2 = chosen.view(n, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # (n, groups)
    keep = torch.zeros_like(best2).scatter_(
        1, torch.topk(best2, k=topk_group, dim=-1, sorted=False)[1], 1.0)
    allowed = keep.bool()[:, :, None].expand(n, groups, e // groups).reshape(n, e)
    idx = torch.topk(chosen.masked_fill(~allowed, float("-inf")), k=top_k, dim=-1,
                     sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


class GroupedRouter(nn.Module):
    """The router's weight (E, H), computed in float32, and its correction bias (E,)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))


class GroupedMoE(nn.Module):
    """Router + routed experts (`routed_moe.Experts`, run the same ways) + the shared experts
    (one dense MLP `moe_intermediate_size * n_shared` wide); names as transformers' GLM-4.5
    (`gate`, `experts`, `shared_experts`)."""

    def __init__(self, cfg: ModelConfig, groups: int, topk_group: int, scale: float,
                 shared: int) -> None:
        super().__init__()
        self.top_k, self.norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.groups, self.topk_group, self.scale = groups, topk_group, scale
        self.gate = GroupedRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * shared)

    def fuse(self) -> None:
        self.experts.fuse()
        self.shared_experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        w, idx = route_grouped(logits, self.gate.e_score_correction_bias, self.top_k,
                               self.groups, self.topk_group, self.norm, self.scale)
        return self.experts(x, w, idx) + self.shared_experts(x)
