"""The gated MLP of Llama-like layers: SwiGLU, or GeGLU (tanh GELU) for Gemma."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from layersplit.shards.layers.fused_linear import concat_linears
from layersplit.shards.model_config import ModelConfig
from torch import nn


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config `hidden_act` -> function (`gelu_pytorch_tanh`: Gemma's)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        f = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, f, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, f, bias=False)
        self.down_proj = nn.Linear(f, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by `fuse_projections` (GPU)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def fuse(self) -> None:
        if self.gate_up_proj is not None:  # (fused already)
            return
        self.gate_up_proj = concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            # (a GPU's row of a layer off the fused step: SiLU(g) * u in the GEMV's launch)
            fast = getattr(self.gate_up_proj, "silu_gate_up", None)
            if fast is not None and self.act is F.silu and (h := fast(x)) is not None:
                return self.down_proj(h)
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(g) * u)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
