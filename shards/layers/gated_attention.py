"""The pieces by which the hybrid Qwen models' full-attention layers differ from Qwen3's:
a sigmoid output gate carried in `q_proj`, zero-centred RMSNorms (weight 1 + w) and a rotary
embedding over only the first `partial_rotary_factor` of each head.
"""

from __future__ import annotations

import torch
from torch import nn


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose stored weight w scales by (1 + w), in float32 (Qwen3-Next, Qwen3.5)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def split_query_gate(
    q_proj_out: torch.Tensor, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q_proj` output (n, H * 2D), laid out per head as [query | gate], as the query
    (n, H, D) and the output gate (n, H * D)."""
    n = q_proj_out.shape[0]
    q, gate = q_proj_out.view(n, heads, 2 * head_dim).chunk(2, dim=-1)
    return q, gate.reshape(n, heads * head_dim)


def gate_output(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output (n, H * D) times sigmoid(gate), before `o_proj`."""
    return attn * torch.sigmoid(gate)


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """Dims of each head the rotary embedding turns (the rest pass through)."""
    return int(head_dim * partial_rotary_factor)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first R dims of each head, R = cos.shape[-1].
    x: (n, heads, D); cos, sin: (n, R)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos[:, None, :] + _rotate_half(rot) * sin[:, None, :]
    return torch.cat([rot, rest], dim=-1)
