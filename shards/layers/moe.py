"""Qwen3-Next's sparse mixture-of-experts MLP: top-k routing over per-expert SwiGLU MLPs, plus a
shared expert scaled by a sigmoid gate. Exact torch; tokens are grouped by expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, inner: int, shared_inner: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(SwiGLU(hidden, inner) for _ in range(num_experts))
        self.shared_expert = SwiGLU(hidden, shared_inner)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, hidden)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (n, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, which = torch.where(chosen == e)
            y = self.experts[e](x[rows]) * weights[rows, which, None]
            out.index_add_(0, rows, y)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
