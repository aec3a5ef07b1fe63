"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`, `shards.glm4_moe_config`): Llama-like attention with q/k/v
biases, q/k norms where configured and the rotary on the first `partial_rotary_factor` of each
head (`LayerRange` builds the rope that wide; `apply_rope` leaves the rest); the first
`first_k_dense_replace` MLPs dense, the others `GroupedMoE` (DeepSeek-V3's: sigmoid routing with
a correction bias, grouped top-k, shared experts). Runs unfused on GPUs (`shards.fused` fuses the
Llama layout only); its q/k/v and expert weights are still concatenated there
(`fuse_weights`)."""

from __future__ import annotations

from layersplit.shards.layers.grouped_moe import ROUTER_FLOAT32_TENSORS, GroupedMoE
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models import llama

FLOAT32_TENSORS = ROUTER_FLOAT32_TENSORS  # (as transformers keeps them)


class DecoderLayer(llama.DecoderLayer):
    UNFUSED_WHY = ("the fused decode step is the Llama layout's (full rotary, softmax routing); "
                   "GLM's layers run the torch path, inside the CUDA graphs")

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        if cfg.is_moe(layer):
            self.mlp = GroupedMoE(cfg)

    def fuse_weights(self) -> None:
        """The GPU layout of the weights (one q/k/v matrix, one gate/up matrix per MLP) for a
        layer that runs without `shards.fused`'s decode step."""
        self.self_attn.fuse()
        self.mlp.fuse()
