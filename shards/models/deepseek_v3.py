"""The decoder layer of DeepSeek-V3 and Kimi K2 (`deepseek_v3`, `kimi_k2`): the Llama layout
(pre-norms, residuals) with multi-head latent attention (`shards.layers.mla`) and, past the
first `first_k_dense_replace` dense layers, a mixture of experts with grouped sigmoid routing and
shared experts (`shards.layers.sigmoid_moe`). Runs unfused on GPUs (`shards.fused` compiles the
Llama layout only); its experts and dense MLPs take the fused weights (`fuse`)."""

from __future__ import annotations

from layersplit.shards.layers.mla import MLAttention
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.sigmoid_moe import SharedExpertsMoE
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import llama


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.self_attn = MLAttention(cfg)
        self.mlp = SharedExpertsMoE(cfg) if cfg.is_moe(layer) else MLP(cfg)

    def fuse(self) -> None:
        """The GPU layout of the MLP weights (one gate/up matmul; experts as one tensor)."""
        self.mlp.fuse()
