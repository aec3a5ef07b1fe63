"""The decoder layer of the dense Llama-like families: Llama, Mistral, Qwen2 and Qwen3 (they
differ only in config: q/k/v bias, q/k RMSNorm, sliding windows, rope scaling)."""

from __future__ import annotations

import torch
from layersplit.shards.kernels import switched_off
from layersplit.shards.layers.attention import Attention
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.step import SegmentsRefused, StepInfo
from layersplit.shards.model_config import ModelConfig
from torch import nn

# 0: a layer off the fused step keeps its input norm and residual adds as launches of their own
# rather than handing them to its attention's first and its MLP's last launch (`TAKES_NORM`,
# `ADDS_RESIDUAL`); read once, at import
HANDOFFS = not switched_off("LAYERSPLIT_LAYER_HANDOFFS")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fast = None  # a compiled decode step (shards.fused), set on GPUs

    def forward(self, h, cos, sin, kv, layer, slot, step: StepInfo) -> torch.Tensor:
        if self.fast is not None:
            if step.grouped:
                return self.fast(self, h, cos, sin, kv, layer, slot, step)
            out = self.fast.prefill(self, h, cos, sin, kv, layer, slot, step)
            if out is not None:
                return out
        if step.parts:  # (several sequences' eager steps: only the row kernels' path takes it)
            raise SegmentsRefused("this layer runs several sequences' eager steps one by one")
        if HANDOFFS and getattr(self.self_attn, "TAKES_NORM", False):  # (the norm in its
            # first launch)
            a = self.self_attn(h, cos, sin, kv, layer, slot, step, norm=self.input_layernorm)
        else:
            a = self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, slot, step)
        h, normed = self.post_attention_layernorm.add_forward(h, a)  # (h + a, its norm)
        if HANDOFFS and getattr(self.mlp, "ADDS_RESIDUAL", False):  # (the add in its last
            # launch)
            return self.mlp(normed, residual=h)
        return h + self.mlp(normed)
