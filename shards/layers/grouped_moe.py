"""The mixture of experts of DeepSeek-V3, Kimi K2 and GLM-4.5+: routed as DeepSeek-V3 routes
("noaux_tc", `shards.moe_config.GroupRouting`: sigmoid scores, a per-expert correction bias that
only picks, grouped top-k) over SwiGLU experts, plus ungated shared experts every token runs.

Shapes: n = tokens, H = hidden, E = experts, k = experts per token, G = expert groups.
The experts themselves run as every MoE family's (`shards.layers.routed_moe.Experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import gemv_kernels_available, kernel_failed, try_kernel
from layersplit.shards.layers import routed_moe
from layersplit.shards.layers.gemv_linear import KERNEL as GEMV
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.routed_moe import Experts
from layersplit.shards.model_config import ModelConfig
from torch import nn

# The router's weight and correction bias stay float32 in any run dtype, as transformers keeps
# them (`_keep_in_fp32_modules_strict` of DeepSeek-V3 and GLM-4.5): the bias only breaks
# near-ties between experts. (A family module's `FLOAT32_TENSORS`, read by `shards.checkpoint`.)
ROUTER_FLOAT32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def router_logits(x: torch.Tensor, router_w: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), router_w.float()): on a GPU a row of a float32 router one GEMV
    launch (`kernels.gemv`: no copy of the row to float32, no cuBLAS split-K reduction)."""
    if routed_moe.few_rows_kernels(x) and x.shape[0] == 1 and x.stride(1) == 1 and \
            router_w.dtype == torch.float32 and router_w.is_contiguous() and \
            gemv_kernels_available() and not kernel_failed(GEMV):
        from layersplit.shards.kernels.gemv import gemv

        got = try_kernel(GEMV, lambda a, w: gemv(a, w, out_dtype=torch.float32), x, router_w)
        if got is not None:
            return got
    return F.linear(x.float(), router_w.float())


def route_grouped(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                  n_group: int, topk_group: int, norm: bool, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) float32, expert ids (n, k)) as transformers' `DeepseekV3TopkRouter` and
    `Glm4MoeTopkRouter`: sigmoid of the float32 router logits; `bias` (the correction bias)
    added for choosing only; each group scored by the sum of its top 2; the experts of the best
    `topk_group` groups compete for the top k; their unbiased scores, renormalised when `norm`,
    times `scaling`. A few rows on a GPU take one Triton kernel after the router's GEMV
    (`shards.kernels.moe_gemv.moe_route_grouped`)."""
    logits = router_logits(x, router_w)  # (n, E)
    if routed_moe.few_rows_kernels(x) and router_w.shape[0] % n_group == 0 \
            and not kernel_failed("MoE routing"):
        got = try_kernel("MoE routing", routed_moe._kernels.moe_route_grouped, logits,
                         bias.float(), top_k, n_group, topk_group, norm, scaling)
        if got is not None:
            return got
    scores = torch.sigmoid(logits)
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
    """The router's weight (E, H) and its correction bias (E,), both float32
    (`ROUTER_FLOAT32_TENSORS`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))


class GroupedMoE(nn.Module):
    """Router + routed experts + ungated shared experts (one dense MLP
    `shared_expert_intermediate_size` wide, when set); names as transformers' `DeepseekV3MoE`
    and `Glm4MoeMoE` (`gate`, `experts`, `shared_experts`)."""

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
            out = self.shared_experts(x, residual=out)  # (out + shared(x))
        return out
