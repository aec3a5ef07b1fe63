"""Gemma 3 text (`gemma3_text`) config fields, read as transformers' `Gemma3TextConfig` reads
them: a rope per layer kind (global layers: `rope_theta` with any `rope_scaling`; sliding
layers: `rope_local_base_freq`, unscaled), windows every layer but each `sliding_window_pattern`-th,
attention scaled by `query_pre_attn_scalar`, logits soft-capped by `final_logit_softcapping`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layersplit.shards.config_fields import check_layer_types
from layersplit.shards.errors import CheckpointError

GEMMA_FIELDS = frozenset({
    "sliding_window", "layer_types", "sliding_window_pattern", "rope_local_base_freq",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention", "hidden_activation", "cache_implementation",
    # written by save_pretrained beside `layer_types`; transformers reads only the unprefixed one
    "_sliding_window_pattern",
})


def gemma_fields(raw: dict[str, Any], layers: int, source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` fields of a gemma3_text config that differ from the Llama reading."""
    for key, off in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False)):
        if raw.get(key) not in (None, off):
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not implemented for "
                                  "model_type='gemma3_text'")
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: hidden_activation={act!r} is not supported "
                              "(only 'gelu_pytorch_tanh')")
    params = raw.get("rope_parameters")
    nested = isinstance(params, dict) and bool(
        {"full_attention", "sliding_attention"} & params.keys())
    full = dict((params or {}).get("full_attention") or {}) if nested else dict(params or {})
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    full.update(raw.get("rope_scaling") or {})
    theta = full.pop("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local_theta = local.pop("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    if "type" in full and "rope_type" not in full:
        full["rope_type"] = full.pop("type")
    if local.pop("rope_type", local.pop("type", "default")) != "default" or local:
        raise CheckpointError(f"{source}: rope_parameters.sliding_attention={params!r}: only an "
                              "unscaled rope is supported on sliding layers")
    window = raw.get("sliding_window", 4096)
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or pattern < 1:
            raise CheckpointError(f"{source}: sliding_window_pattern={pattern!r} must be >= 1")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    sliding = check_layer_types(source, types, window)
    scalar = raw.get("query_pre_attn_scalar", 256)
    cap = raw.get("final_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or cap <= 0):
        raise CheckpointError(f"{source}: final_logit_softcapping={cap!r} must be > 0 or null")
    return {
        "rope_theta": float(theta),
        "rope_scaling": tuple(sorted((str(k), v) for k, v in full.items())),
        "local_rope_theta": float(local_theta),
        "layer_types": tuple(types) if sliding else (),
        "sliding_window": window if sliding else None,
        "attn_scale": float(scalar) ** -0.5,
        "final_logit_softcap": None if cap is None else float(cap),
        "hidden_act": act,
        "head_dim": int(raw.get("head_dim") or 256),  # transformers' default for Gemma 3
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }
