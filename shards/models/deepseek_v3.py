"""The decoder layer of DeepSeek-V3 and Kimi K2 (`deepseek_v3`, `kimi_k2`): the Llama layout
(pre-norms, residuals) with multi-head latent attention (`shards.layers.mla`) and, past the
first `first_k_dense_replace` dense layers, a mixture of experts with grouped sigmoid routing and
shared experts (`shards.layers.grouped_moe`, as GLM-4.5's). Runs unfused on GPUs
(`shards.fused` compiles the Llama layout only); its experts and dense MLPs take the fused
weights (`fuse_weights`), its attention one matmul for both projections of its input."""

from __future__ import annotations

from layersplit.shards.layers.grouped_moe import ROUTER_FLOAT32_TENSORS, GroupedMoE
from layersplit.shards.layers.mla import MLAttention
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import llama

FLOAT32_TENSORS = ROUTER_FLOAT32_TENSORS  # (as transformers keeps them)


class DecoderLayer(llama.DecoderLayer):
    UNFUSED_WHY = ("the fused decode step is the Llama layout's (latent attention, grouped "
                   "sigmoid routing); these layers run the torch path (their attention the MLA "
                   "kernel), inside the CUDA graphs")

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.self_attn = MLAttention(cfg)
        self.mlp = GroupedMoE(cfg) if cfg.is_moe(layer) else MLP(cfg)

    def fuse_weights(self) -> None:
        """The GPU layout of the weights: one matmul for the query and latent projections of
        the input (`MLAttention.fuse`), one gate/up matmul, experts as one tensor."""
        self.self_attn.fuse()
        self.mlp.fuse()
