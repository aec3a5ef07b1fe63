"""The mixture of experts of DeepSeek-V3, Kimi K2 and GLM-4.5+: routed as DeepSeek-V3 routes
("noaux_tc", `shards.moe_config.GroupRouting`: sigmoid scores, a per-expert correction bias that
only picks, grouped top-k) over SwiGLU experts, plus ungated shared experts every token runs.

Shapes: n = tokens, H = hidden, E = experts, k = experts per token, G = expert groups.
The experts themselves run as every MoE family's (`shards.layers.routed_moe.Experts`).
"""

from __future__ import annotations

import logging
import os

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


def shared_expert_chunks(gate_up: torch.Tensor, down: torch.Tensor, width: int
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A SwiGLU MLP of fused gate/up weight (2F, H) (the gate's F rows, then the up's) and down
    weight (H, F) as S = F / `width` experts in the routed experts' layout: gate/up (S, 2I, H)
    (chunk c's gate rows, then its up rows) and down (S, H, I), I = `width`; the MLP's output is
    the sum of theirs. None where F is not a multiple of `width` or the shapes do not fit."""
    if gate_up.dim() != 2 or down.dim() != 2 or width <= 0:
        return None
    h, f = down.shape
    if f % width or gate_up.shape != (2 * f, h):
        return None
    c = f // width
    g, u = gate_up.view(2, c, width, h).unbind(0)
    return (torch.cat([g, u], dim=1).contiguous(),
            down.view(h, c, width).permute(1, 0, 2).contiguous())


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
        # the shared experts cut into experts of the routed experts' width, (S, 2I, H) and
        # (S, H, I), where a few rows' steps run them in the experts' kernels
        self.shared_chunks: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        self.experts.fuse()
        if self.shared_experts is not None:
            self.shared_experts.fuse()
            self.shared_chunks = self.shared_as_experts()

    def shared_as_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' weights as S more experts of the routed experts' width I, where
        their width is a multiple of I (DeepSeek-V2/V3, Kimi K2, GLM-4.5): shared(x) = sum over
        chunks c of down_c (silu(gate_c x) * up_c x), so a few rows' step reads them in the
        routed experts' two kernels, each chunk an expert of weight 1 that the routing kernel
        appends to every row's k (`moe_gemv.moe_route_grouped`'s `extra`), instead of two more
        GEMV launches. A copy of the shared weights (the MLP keeps its own for the steps of
        many rows). None where the kernels do not run, the widths or dtypes do not fit, or
        `LAYERSPLIT_SHARED_AS_EXPERTS=0`."""
        gu, dn = self.experts.gate_up_proj, self.experts.down_proj
        sh = self.shared_experts
        if sh is None or gu is None or not gu.is_cuda or routed_moe._kernels is None or \
                os.environ.get(SHARED_AS_EXPERTS, "1").strip().lower() in ("0", "false", "off",
                                                                          "no"):
            return None
        sgu = getattr(sh.gate_up_proj, "weight", None)
        sdn = getattr(sh.down_proj, "weight", None)
        if not (isinstance(sgu, torch.Tensor) and isinstance(sdn, torch.Tensor)) or \
                sgu.dtype != gu.dtype or sdn.dtype != dn.dtype:
            return None
        chunks = shared_expert_chunks(sgu.detach(), sdn.detach(), dn.shape[2])
        if chunks is not None:
            log.debug("shared experts as %d experts of width %d in the experts' kernels",
                      chunks[0].shape[0], dn.shape[2])
        return chunks

    def _few_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """A few rows on a GPU with `shared_chunks`: the routing kernel's k experts and the
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
                         self.topk_group, self.norm, self.scaling, self.shared_chunks[0].shape[0])
        if got is None:
            return None
        return try_kernel("MoE GEMV", kernels.moe_gemv, x, got[0], got[1], gu, dn,
                          *self.shared_chunks, residual)

    ADDS_RESIDUAL = True  # (`forward`'s residual: the decoder layer's add, `llama.DecoderLayer`)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' and shared experts' output for rows `x`, plus `residual` where given
        (the layer's residual stream: on a few rows' kernel path, added in their last launch;
        else as the layer added it, after the MoE's own sum)."""
        if self.shared_chunks is not None and routed_moe.few_rows_kernels(x):
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
