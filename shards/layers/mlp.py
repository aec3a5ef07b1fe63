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

    ADDS_RESIDUAL = True  # (`forward`'s residual: the decoder layer's add, `llama.DecoderLayer`)

    def fuse(self) -> None:
        if self.gate_up_proj is not None:  # (fused already)
            return
        self.gate_up_proj = concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of rows `x`, plus `residual` where given (a shared expert's: the routed
        experts' sum)."""
        if self.gate_up_proj is not None:
            # (a GPU's row of a layer off the fused step: SiLU(g) * u in the GEMV's launch)
            fast = getattr(self.gate_up_proj, "silu_gate_up", None)
            if fast is None or self.act is not F.silu or (h := fast(x)) is None:
                g, u = self.gate_up_proj(x).chunk(2, dim=-1)
                h = self.act(g) * u
        else:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        if residual is None:
            return self.down_proj(h)
        add_to = getattr(self.down_proj, "add_to", None)  # (the add in the GEMV's launch)
        return residual + self.down_proj(h) if add_to is None else add_to(residual, h)
