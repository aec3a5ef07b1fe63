"""The decoder layer of the Llama-like mixture-of-experts families: Qwen3-MoE, Qwen2-MoE and
Mixtral. Attention as the dense families (`shards.models.llama`); the MLP is a `RoutedMoE`, or
dense on the layers the config lists (Qwen's `mlp_only_layers` / `decoder_sparse_step`)."""

from __future__ import annotations

from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.routed_moe import RoutedMoE
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import llama


class DecoderLayer(llama.DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        if cfg.is_moe(layer):
            # Mixtral multiplies the expert outputs by float32 router weights; Qwen casts first
            self.mlp = RoutedMoE(cfg, float_weights=cfg.model_type == "mixtral")
        else:
            self.mlp = MLP(cfg)
