"""Gemma 3 text (`gemma3_text`): Llama-like attention with q/k norms, but "sandwich" norms (each
of attention and MLP normed before and after), norms that scale by 1 + weight, a tanh-GELU
MLP, token embeddings scaled by sqrt(hidden), attention scores by query_pre_attn_scalar ** -0.5,
sliding layers on their own rope base (`LayerRange` picks it by window) and soft-capped logits
(`LayerRange`). Runs unfused on GPUs too (`shards.fused` fuses the Llama layout only)."""

from __future__ import annotations

import torch
from layersplit.shards.layers.attention import Attention
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.norm import OffsetRMSNorm
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.model_config import ModelConfig
from torch import nn

FinalNorm = OffsetRMSNorm  # the last range's norm (`LayerRange`)


def embed_scale(cfg: ModelConfig) -> float:
    """What the token embeddings are multiplied by (transformers keeps it in float32 and casts
    it to the weights' dtype)."""
    return cfg.hidden_size ** 0.5


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer)
        self.self_attn.q_norm = OffsetRMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = OffsetRMSNorm(cfg.head_dim, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.fast = None

    def forward(self, h, cos, sin, kv, layer, slot, step: StepInfo) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, slot, step)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)
