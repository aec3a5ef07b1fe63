"""gpt-oss's mixture of experts: a biased router whose top k logits are softmaxed, and experts
that are clamped SwiGLUs with biased projections, stored as transformers holds them (gate and up
interleaved in one (E, H, 2I) matrix applied as x @ W, down (E, I, H)).

Shapes: n = tokens, H = hidden, E = experts, I = an expert's width, k = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import kernel_failed, try_kernel
from layersplit.shards.layers import routed_moe
from layersplit.shards.layers.routed_moe import (
    GATHER_ROWS,
    _grouped_mm,
    expert_groups,
    grouped_gemm_applies,
    pair_outputs,
    sum_experts,
    sum_sorted_experts,
)
from layersplit.shards.model_config import ModelConfig
from torch import nn


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(.., 2I) interleaved gate/up -> (.., I): g * sigmoid(alpha * g) * (u + 1), with g
    clamped to <= limit and u to [-limit, limit]."""
    gate = gate_up[..., ::2].clamp(min=None, max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class OssRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts))


class OssExperts(nn.Module):
    """The E experts' weights and biases under transformers' names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.gpt_oss.swiglu_alpha, cfg.gpt_oss.swiglu_limit

    def fuse(self) -> None:
        """The GPU layout: each expert's matrices column-major (the same logical (E, H, 2I) and
        (E, I, H) tensors), as the grouped GEMM's kernels read their second operand, and the
        GEMV kernels their rows."""
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name)
            if w.stride(-2) != 1:
                setattr(self, name, nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2),
                                                 requires_grad=False))
        if self.gate_up_proj.is_cuda:
            routed_moe.load_gemv()

    def _grouped_gemm(self, x: torch.Tensor) -> bool:
        """Whether `_grouped` runs grouped GEMMs (the device takes them, and the weights are
        in `fuse`'s layout), not a gather of each row's weights."""
        return grouped_gemm_applies(x) and self.gate_up_proj.stride(-2) == 1 and \
            self.down_proj.stride(-2) == 1

    def _gemv(self, x: torch.Tensor) -> bool:
        """Whether rows `x` take `shards.kernels.moe_gemv`'s GEMVs (few rows on a GPU, the
        weights in `fuse`'s layout)."""
        return routed_moe.few_rows_kernels(x) and self.gate_up_proj.stride(-2) == 1 and \
            self.down_proj.stride(-2) == 1 and not kernel_failed("MoE GEMV")

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self._gemv(x):
            out = try_kernel("MoE GEMV", routed_moe._kernels.oss_moe_gemv, x, w, idx,
                             self.gate_up_proj.transpose(1, 2), self.gate_up_proj_bias,
                             self.down_proj.transpose(1, 2), self.down_proj_bias, self.alpha,
                             self.limit)
            if out is not None:
                return out
        if x.is_cuda and (self._grouped_gemm(x) or idx.numel() <= GATHER_ROWS):
            return self._grouped(x, w, idx)
        return self._loop(x, w, idx)

    def _loop(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """One expert at a time in increasing id over the rows that picked it, each row's k
        outputs summed as transformers (`routed_moe.sum_experts`; one host sync for the
        counts)."""
        ys = pair_outputs(x, w, idx)
        for e, pick, rows in expert_groups(idx, self.down_proj.shape[0]):
            g = clamped_swiglu(x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e],
                               self.alpha, self.limit)
            ys[pick] = (g @ self.down_proj[e] + self.down_proj_bias[e]) * w.reshape(-1)[pick, None]
        return sum_experts(ys, idx.shape[1], x.dtype)

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The (token, expert) rows sorted by expert, each projection one grouped GEMM (or, where
        the device has none for the dtype, a gather of each row's weights): no host sync, so it
        runs inside CUDA graphs."""
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows, ex = order // k, flat[order]
        xs = x[rows]
        if self._grouped_gemm(x):
            counts = torch.zeros(self.down_proj.shape[0], dtype=torch.int32,
                                 device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            g = clamped_swiglu(_grouped_mm(xs, self.gate_up_proj, offs=offs)
                               + self.gate_up_proj_bias[ex], self.alpha, self.limit)
            y = _grouped_mm(g, self.down_proj, offs=offs) + self.down_proj_bias[ex]
        else:
            g = clamped_swiglu(torch.bmm(xs[:, None, :], self.gate_up_proj[ex])[:, 0]
                               + self.gate_up_proj_bias[ex], self.alpha, self.limit)
            y = torch.bmm(g[:, None, :], self.down_proj[ex])[:, 0] + self.down_proj_bias[ex]
        return sum_sorted_experts(y, order, w, x.dtype)


class OssMoE(nn.Module):
    """Router + experts; names as transformers' `GptOssMLP` (`router`, `experts`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = OssRouter(cfg)
        self.experts = OssExperts(cfg)

    def fuse(self) -> None:
        self.experts.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        if routed_moe.few_rows_kernels(x) and not kernel_failed("MoE routing"):
            # (one kernel: the top k, their softmax)
            got = try_kernel("MoE routing", routed_moe._kernels.moe_route_softmax_top, logits,
                             self.top_k)
            if got is not None:
                return self.experts(x, got[0].to(logits.dtype), got[1])
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=1, dtype=top.dtype), idx)
