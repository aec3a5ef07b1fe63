"""gpt-oss (`gpt_oss`) config fields, read as transformers' `GptOssConfig` reads them: attention
sinks and q/k/v/o biases in every layer, sliding and full layers alternating (`layer_types`,
by default even layers windowed by `sliding_window`), YaRN rope by default, and in every layer a
mixture of `num_local_experts` experts of width `intermediate_size`: the router (with a bias)
keeps the top k logits and softmaxes them; each expert is a clamped SwiGLU
(`swiglu_alpha`, `swiglu_limit`) with biased projections. A `quantization_config` may only say
`mxfp4` (the experts' weights, dequantized at load: `shards.checkpoint_hf`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from layersplit.shards.config_fields import check_layer_types
from layersplit.shards.errors import CheckpointError

GPT_OSS_FIELDS = frozenset({
    "layer_types", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
    "experts_per_token", "swiglu_alpha", "swiglu_limit", "quantization_config",
    # never read by transformers' model code: the context YaRN's original length restates
    "initial_context_length",
    # router losses: training only
    "router_aux_loss_coef", "output_router_logits",
})
# the quantization_config keys of an MXFP4 checkpoint (what stays unquantized is read from
# the tensors themselves: a `_blocks` / `_scales` pair or a plain tensor)
_MXFP4_KEYS = frozenset({"quant_method", "modules_to_not_convert"})
# gpt-oss's rope when its config names none (transformers' GptOssConfig default)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True, slots=True)
class GptOssSpec:
    swiglu_alpha: float  # an expert's gate: g * sigmoid(alpha * g), g clamped to <= limit
    swiglu_limit: float  # ... and its up projection clamped to [-limit, limit], plus 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_mxfp4(raw: dict[str, Any]) -> bool:
    """Whether a gpt_oss config says its experts are stored as MXFP4 blocks."""
    q = raw.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def gpt_oss_fields(raw: dict[str, Any], rope: dict[str, Any], layers: int,
                   source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` fields of a gpt_oss config that differ from the Llama reading."""
    q = raw.get("quantization_config")
    if q is not None:
        if not is_mxfp4(raw) or set(q) - _MXFP4_KEYS:
            raise CheckpointError(f"{source}: quantization_config={q!r} is not implemented for "
                                  "model_type='gpt_oss' (only quant_method 'mxfp4')")
    experts = raw.get("num_local_experts", raw.get("num_experts", 128))
    top_k = raw.get("num_experts_per_tok", 4)
    if raw.get("experts_per_token", top_k) != top_k:
        raise CheckpointError(f"{source}: experts_per_token={raw['experts_per_token']!r} differs "
                              f"from num_experts_per_tok={top_k!r}")
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{source}: {key}={value!r} must be a positive integer")
    if top_k > experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be in 1..{experts}")
    window = raw.get("sliding_window", 128)
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    sliding = check_layer_types(source, types, window)
    spec = {}
    for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{source}: {key}={value!r} must be a positive number")
        spec[key] = float(value)
    rope = dict(rope) if rope else dict(DEFAULT_ROPE)
    return {
        "rope_scaling": tuple(sorted((str(k), v) for k, v in rope.items())),
        "rope_theta": float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get(
            "rope_theta", 150000.0))),
        "layer_types": tuple(types) if sliding else (),
        "sliding_window": window if sliding else None,
        "num_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(raw["intermediate_size"]),
        "norm_topk_prob": True,  # (a softmax over the top k)
        "gpt_oss": GptOssSpec(**spec),
    }
