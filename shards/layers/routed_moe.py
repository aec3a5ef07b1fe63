"""Routed mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks the top k of E
SwiGLU experts per token; their outputs are summed weighted by the router's probabilities.

Shapes: n = tokens, H = hidden, E = experts, I = an expert's width, k = experts per token.

Two ways to run the experts, same math:
- `loop_experts`: one pass per expert that some token picked, over the rows that picked it
  (transformers' own order). Exact reference; costs one host sync per layer (the counts).
- `grouped_experts`: the n*k (token, expert) rows sorted by expert and run as one grouped GEMM
  (`torch.nn.functional.grouped_mm`) per projection. No host sync and fixed shapes, so it can
  live in a CUDA graph: the decode path (`shards.fused`) and CUDA steps use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import fused_kernels_available, kernel_failed, try_kernel
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.model_config import ModelConfig
from torch import nn

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm: bool,
          float_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k), expert ids (n, k)): softmax over all E router logits in float32, the
    top k, renormalised to sum to 1 when `norm`. The weights stay float32 with
    `float_weights` (Mixtral), else they take x's dtype (Qwen). A few rows on a GPU take one
    Triton kernel after the router's GEMV (`shards.kernels.moe_gemv.moe_route`)."""
    if few_rows_kernels(x):  # (the weights stored in x's dtype by the kernel: no cast)
        return _kernels.moe_route(F.linear(x, router_w), top_k, norm,
                                  None if float_weights else x.dtype)
    probs = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return (w if float_weights else w.to(x.dtype)), idx


def _gate_up(gate_up: torch.Tensor | None, gate: torch.Tensor | None, up: torch.Tensor | None,
             x: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up is not None:
        return F.linear(x, gate_up[e]).chunk(2, dim=-1)
    return F.linear(x, gate[e]), F.linear(x, up[e])


def expert_groups(idx: torch.Tensor, experts: int
                  ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The (token, slot) pairs of the routing `idx` (n, k) grouped by expert, in increasing
    id, experts no row chose left out: (expert, the pairs' flat indices into idx, their
    rows)."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    start = 0
    for e, c in enumerate(torch.bincount(flat, minlength=experts).tolist()):
        if c == 0:
            continue
        pick = order[start:start + c]
        start += c
        yield e, pick, pick // k


def loop_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                 gate_up: torch.Tensor | None, gate: torch.Tensor | None,
                 up: torch.Tensor | None, down: torch.Tensor) -> torch.Tensor:
    """Sum over each row's k experts of weight * down(silu(gate(x)) * up(x)), one expert at a
    time in increasing id (each expert's rows in one matmul), summed as transformers does
    (`sum_experts`). Give either `gate_up` (E, 2I, H) or `gate` and `up` (E, I, H); `down` is
    (E, H, I)."""
    ys = pair_outputs(x, w, idx)
    for e, pick, rows in expert_groups(idx, down.shape[0]):
        g, u = _gate_up(gate_up, gate, up, x[rows], e)
        ys[pick] = F.linear(F.silu(g) * u, down[e]) * w.reshape(-1)[pick, None]
    return sum_experts(ys, idx.shape[1], x.dtype)


def pair_outputs(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """An (n*k, H) buffer for the weighted expert outputs of each (row, slot) pair of `idx`
    (n, k), in the product's dtype: float32 where the router's weights `w` are (GLM, DeepSeek,
    Mixtral), else x's."""
    return x.new_empty((idx.numel(), x.shape[-1]), dtype=torch.promote_types(x.dtype, w.dtype))


def sum_experts(ys: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row's k weighted expert outputs `ys` (n*k, H, slot order within a row) summed as
    transformers' experts sum them (its default `grouped_mm` path): accumulated in float32,
    rounded to `dtype` once. Adding them one by one into a half-dtype sum rounds k times (8
    for GLM-4.5-Air and Qwen3-30B-A3B), and with float32 router weights each product once more
    (`tests/shards/test_moe.py` pins transformers' sums bit for bit)."""
    return ys.view(-1, k, ys.shape[-1]).sum(dim=1).to(dtype)


def sum_sorted_experts(y: torch.Tensor, order: torch.Tensor, w: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """`sum_experts` of the grouped paths' outputs `y` (n*k, H) in expert order (`order`: the
    argsort of the (row, slot) pairs by expert): put back in (row, slot) order while still in
    the run dtype, then weighted by the router's `w` (n, k) (in float32 where w is: one float32
    (n*k, H) buffer at a time, not two)."""
    ys = torch.empty_like(y)
    ys[order] = y
    return sum_experts(ys * w.reshape(-1, 1), w.shape[-1], dtype)


def grouped_gemm_applies(x: torch.Tensor) -> bool:
    """Whether `grouped_experts` runs grouped GEMMs for `x` (CUDA kernels take bfloat16 only);
    else it gathers each row's expert weights, which costs memory per row."""
    return _grouped_mm is not None and (not x.is_cuda or x.dtype == torch.bfloat16)


# rows (tokens x k) up to which a CUDA step without grouped GEMMs still gathers weights (a
# decode or verify step, in its graph); longer steps loop over experts (one host sync)
GATHER_ROWS = 64


def experts_sync_free(pairs: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA step's experts over `pairs` (token, expert) pairs in `dtype` run without
    a host sync (`grouped_experts`, which a CUDA graph may capture): grouped GEMMs, or few
    enough pairs to gather their weights; else `loop_experts`."""
    return (_grouped_mm is not None and dtype == torch.bfloat16) or pairs <= GATHER_ROWS
# tokens up to which the selected experts run as GEMVs (`shards.kernels.moe_gemv`) that read
# only their weights, not as a grouped GEMM over all experts (LAYERSPLIT_MOE_GEMV_TOKENS=0: never,
# for measuring one against the other)
GEMV_TOKENS = int(os.environ.get("LAYERSPLIT_MOE_GEMV_TOKENS", "8"))


_kernels = None  # `shards.kernels.moe_gemv` once `load_gemv` found it usable


def load_gemv() -> None:
    """Import the GEMV and routing kernels where they can run (CUDA, Triton, not switched off).
    Called when weights are fused for a GPU, before any step is traced:
    `torch.compile(fullgraph=True)` code cannot import or probe the environment itself."""
    global _kernels
    if _kernels is None and GEMV_TOKENS > 0 and torch.cuda.is_available() \
            and fused_kernels_available("cuda"):
        from layersplit.shards.kernels import moe_gemv
        _kernels = moe_gemv


def few_rows_kernels(x: torch.Tensor) -> bool:
    """Whether the experts and routing of rows `x` take the kernels of
    `shards.kernels.moe_gemv` (loaded, a CUDA step of at most `GEMV_TOKENS` rows)."""
    return _kernels is not None and x.is_cuda and x.shape[0] <= GEMV_TOKENS


def _gemv_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    return few_rows_kernels(x) and gate_up.is_contiguous() and down.is_contiguous()


def grouped_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, gemv: bool = True) -> torch.Tensor:
    """`loop_experts` as two grouped GEMMs over the rows sorted by expert: no host sync, so it
    can be captured in a CUDA graph. `gate_up` (E, 2I, H) (the fused layout), `down` (E, H, I).
    A few rows on a GPU take the GEMV kernels instead (`GEMV_TOKENS`), unless `gemv` is
    False."""
    if gemv and _gemv_applies(x, gate_up, down):
        return _kernels.moe_gemv(x, w, idx, gate_up, down)
    k = idx.shape[1]
    e_count = down.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // k
    counts = torch.zeros(e_count, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[rows]
    if grouped_gemm_applies(x):
        g, u = _grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = _grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)
    else:  # no grouped GEMM for this device/dtype: gather each row's expert weights
        ex = flat[order]
        g, u = torch.bmm(gate_up[ex], xs[:, :, None]).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(down[ex], (F.silu(g) * u)[:, :, None]).squeeze(-1)
    return sum_sorted_experts(y, order, w, x.dtype)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights (the layout of transformers' fused experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj: nn.Parameter | None = None  # set by `fuse` (GPU)

    def fuse(self) -> None:
        """One (E, 2I, H) gate/up weight: the grouped GEMM's layout; once."""
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = nn.Parameter(torch.cat([self.gate_proj, self.up_proj], dim=1),
                                         requires_grad=False)
        del self.gate_proj, self.up_proj
        if self.gate_up_proj.is_cuda:
            load_gemv()

    def gate_up(self) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.gate_up_proj
        return torch.cat([self.gate_proj, self.up_proj], dim=1)

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and experts_sync_free(idx.numel(), x.dtype):
            # no host sync: CUDA graphs and long prefills alike; a few rows through the GEMV
            # kernels, unless they failed once (`try_kernel`)
            gate_up = self.gate_up()
            if _gemv_applies(x, gate_up, self.down_proj) and not kernel_failed("MoE GEMV"):
                out = try_kernel("MoE GEMV", _kernels.moe_gemv, x, w, idx, gate_up,
                                 self.down_proj)
                if out is not None:
                    return out
            return grouped_experts(x, w, idx, gate_up, self.down_proj, gemv=False)
        fused = self.gate_up_proj is not None
        return loop_experts(x, w, idx, self.gate_up_proj, None if fused else self.gate_proj,
                            None if fused else self.up_proj, self.down_proj)


class RoutedMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert); parameter names follow
    transformers' (`gate`, `experts`, `shared_expert`, `shared_expert_gate`)."""

    def __init__(self, cfg: ModelConfig, float_weights: bool = False) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.float_weights = float_weights
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def fuse(self) -> None:
        self.experts.fuse()
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def graph_safe(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a step of `rows` tokens in `dtype` runs without a host sync on a GPU (so a
        CUDA graph may capture it): grouped GEMMs, or few enough rows x experts to gather
        (`Experts.forward`)."""
        return experts_sync_free(rows * self.top_k, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = route(x, self.gate.weight, self.top_k, self.norm_topk_prob, self.float_weights)
        out = self.experts(x, w, idx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
