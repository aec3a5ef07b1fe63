"""From a config's `model_type` to the module of its family, and the layers it builds."""

from __future__ import annotations

import importlib

from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import ModelConfig
from torch import nn

# model_type -> the module under shards.models that builds its decoder layers
FAMILY_MODULES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "moe_llama",
    "qwen2_moe": "moe_llama",
    "mixtral": "moe_llama",
    "gemma3_text": "gemma3",
    "qwen3_5_text": "qwen3_5",  # hybrid: ranges are shards.models.qwen3_5.HybridRange
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_next": "qwen3_5",
    "deepseek_v3": "deepseek_v3",  # latent attention (MLA), grouped sigmoid routing
    "kimi_k2": "deepseek_v3",
}


def family_module(cfg: ModelConfig):
    name = FAMILY_MODULES.get(cfg.model_type)
    if name is None:
        raise CheckpointError(f"model_type={cfg.model_type!r} has no model code (known: "
                              f"{', '.join(sorted(FAMILY_MODULES))})")
    return importlib.import_module(f"{__package__}.{name}")


def decoder_layer(cfg: ModelConfig, layer: int) -> nn.Module:
    """Global layer `layer` of a model of `cfg`'s family, with fresh (uninitialised) weights."""
    return family_module(cfg).DecoderLayer(cfg, layer)
