"""The mixture of experts of DeepSeek-V3, Kimi K2 and GLM-4.5+: routed as DeepSeek-V3 routes
("noaux_tc", `shards.moe_config.GroupRouting`: sigmoid scores, a per-expert correction bias that
only picks, grouped top-k) over SwiGLU experts, plus ungated shared experts every token runs.

Shapes: n = tokens, H = hidden, E = experts, k = experts per token, G = expert groups.
The experts themselves run as every MoE family's (`shards.layers.routed_moe.Experts`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import (
    fused_kernels_available,
    gemv_kernels_available,
    kernel_failed,
    switched_off,
    try_kernel,
)
from layersplit.shards.kernels.gemv_operands import shared_chunks
from layersplit.shards.layers import routed_moe
from layersplit.shards.layers.gemv_linear import KERNEL as GEMV
from layersplit.shards.layers.gemv_linear import GemvLinear
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.routed_moe import Experts
from layersplit.shards.model_config import ModelConfig
from torch import nn

# The router's weight and correction bias stay float32 in any run dtype, as transformers keeps
# them (`_keep_in_fp32_modules_strict` of DeepSeek-V3 and GLM-4.5): the bias only breaks
# near-ties between experts. (A family module's `FLOAT32_TENSORS`, read by `shards.checkpoint`.)
ROUTER_FLOAT32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
# 0: a few rows' shared experts run as their own two GEMVs, not as experts of the routed
# experts' kernels (`GroupedMoE.shared_as_experts`)
SHARED_AS_EXPERTS = "LAYERSPLIT_SHARED_AS_EXPERTS"

log = logging.getLogger(__name__)


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
        # the shared experts' chunks of the routed experts' width that a few rows' steps run
        # as experts in the experts' kernels (`shared_as_experts`); 0: none
        self.shared_in_kernels = 0

    def fuse(self) -> None:
        self.experts.fuse()
        if self.shared_experts is not None:
            self.shared_experts.fuse()
            self.shared_in_kernels = self.shared_as_experts()

    def shared_as_experts(self) -> int:
        """How many experts of the routed experts' width I the shared experts make in a few
        rows' steps (0: none): where their SwiGLU's width F is a multiple of I (DeepSeek-V2/V3,
        Kimi K2, GLM-4.5), shared(x) = the sum over chunks c of down_c (silu(gate_c x) *
        up_c x), so the routed experts' two kernels read the MLP's weights in place as F / I
        more experts of weight 1, which the routing kernel appends to every row's k
        (`moe_gemv.run_gemv`'s `shared`, `moe_route_grouped`'s `extra`), instead of two more
        GEMV launches. 0 where the kernels do not run, the MLP is not a plain bias-free SwiGLU
        of the experts' dtype, or `LAYERSPLIT_SHARED_AS_EXPERTS=0`."""
        gu = getattr(self.experts, "gate_up_proj", None)
        dn = getattr(self.experts, "down_proj", None)
        sh, kernels = self.shared_experts, routed_moe._kernels
        if sh is None or kernels is None or not isinstance(gu, torch.Tensor) or \
                not isinstance(dn, torch.Tensor) or dn.dim() != 3 or \
                not fused_kernels_available(gu.device) or \
                switched_off(SHARED_AS_EXPERTS):
            return 0
        lin = (sh.gate_up_proj, sh.down_proj)
        if sh.act is not F.silu or not all(type(m) in (nn.Linear, GemvLinear) and m.bias is None
                                           for m in lin):
            return 0
        sgu, sdn = lin[0].weight, lin[1].weight
        if sgu.dtype != gu.dtype or sdn.dtype != dn.dtype:
            return 0
        count = shared_chunks(sgu, sdn, dn.shape[2]) or 0
        if count:
            log.debug("shared experts as %d experts of width %d in the experts' kernels", count,
                      dn.shape[2])
        return count

    def _few_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """A few rows on a GPU with `shared_in_kernels`: the routing kernel's k experts and the
        shared chunks, all in the experts' kernels (four launches after the router's GEMV),
        `residual` added in the last; None where a kernel failed once (the other path then
        runs)."""
        gu, dn = self.experts.gate_up_proj, self.experts.down_proj
        if not routed_moe._gemv_applies(x, gu, dn) or kernel_failed("MoE routing") or \
                kernel_failed("MoE GEMV") or self.gate.weight.shape[0] % self.n_group or \
                (residual is not None and not (residual.shape == x.shape and
                                               residual.dtype == x.dtype and
                                               residual.is_contiguous())):
            return None
        kernels = routed_moe._kernels
        logits = router_logits(x, self.gate.weight)
        got = try_kernel("MoE routing", kernels.moe_route_grouped, logits,
                         self.gate.e_score_correction_bias.float(), self.top_k, self.n_group,
                         self.topk_group, self.norm, self.scaling, self.shared_in_kernels)
        if got is None:
            return None
        sh = self.shared_experts
        return try_kernel("MoE GEMV", kernels.moe_gemv, x, got[0], got[1], gu, dn,
                          sh.gate_up_proj.weight, sh.down_proj.weight, residual)

    ADDS_RESIDUAL = True  # (`forward`'s residual: the decoder layer's add, `llama.DecoderLayer`)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' and shared experts' output for rows `x`, plus `residual` where given
        (the layer's residual stream: on a few rows' kernel path, added in their last launch;
        else as the layer added it, after the MoE's own sum)."""
        if self.shared_in_kernels and routed_moe.few_rows_kernels(x):
            out = self._few_rows(x, residual)
            if out is not None:
                return out
        w, idx = route_grouped(x, self.gate.weight, self.gate.e_score_correction_bias,
                               self.top_k, self.n_group, self.topk_group, self.norm,
                               self.scaling)
        out = self.experts(x, w, idx)
        if self.shared_experts is not None:
            out = self.shared_experts(x, residual=out)  # (out + shared(x))
        return out if residual is None else residual + out
