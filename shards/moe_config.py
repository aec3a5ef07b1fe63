"""The mixture-of-experts fields of an HF `config.json`, read as transformers reads them.

Qwen3-MoE and Qwen2-MoE route with a softmax over all experts, keep the top k and renormalise
them when `norm_topk_prob`; their layers are sparse unless listed in `mlp_only_layers` or off
the `decoder_sparse_step` stride. Mixtral always renormalises the top k (a softmax over the top-k
logits) and every layer is sparse; its expert width is `intermediate_size`. Qwen2-MoE adds a
shared expert gated by a sigmoid.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from layersplit.shards.errors import CheckpointError

_WINDOWS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers"})
# Read by transformers for training only (router loss and its logits): no effect on outputs.
# (Mixtral's `router_jitter_noise` multiplies the input by noise only while training.)
_TRAINING_ONLY = frozenset({"output_router_logits", "router_aux_loss_coef"})
_QWEN_MOE = frozenset({"decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok",
                       "num_experts", "num_local_experts", "norm_topk_prob", "mlp_only_layers"})

MOE_FAMILY_FIELDS: dict[str, frozenset[str]] = {
    "qwen3_moe": _WINDOWS | _TRAINING_ONLY | _QWEN_MOE,
    "qwen2_moe": _WINDOWS | _TRAINING_ONLY | _QWEN_MOE | {
        "layer_types", "shared_expert_intermediate_size", "qkv_bias"},
    "mixtral": _TRAINING_ONLY | {"sliding_window", "num_experts_per_tok", "num_local_experts",
                                 "router_jitter_noise"},
}


def _int(raw: dict[str, Any], key: str, source: str | Path, default: Any = ...) -> int:
    value = raw.get(key, default)
    if value is ...:
        raise CheckpointError(f"{source}: required field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{source}: {key}={value!r} must be a non-negative integer")
    return value


def moe_fields(raw: dict[str, Any], model_type: str, layers: int,
               source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` MoE fields of a config (none for a dense family)."""
    if model_type not in MOE_FAMILY_FIELDS:
        return {}
    # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts` (an alias)
    experts_key = "num_local_experts" if model_type == "mixtral" or "num_experts" not in raw \
        else "num_experts"
    experts = _int(raw, experts_key, source)
    top_k = _int(raw, "num_experts_per_tok", source)
    if experts and not 0 < top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be in 1..{experts} "
                              f"(the number of experts)")
    if model_type == "mixtral":
        return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": _int(raw, "intermediate_size", source)}
    step = _int(raw, "decoder_sparse_step", source, 1)
    if step < 1:
        raise CheckpointError(f"{source}: decoder_sparse_step={step} must be >= 1")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(f"{source}: mlp_only_layers={only!r} must be a list of layer "
                              "indices")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if not experts:  # transformers builds every layer dense
        return {}
    shared = (_int(raw, "shared_expert_intermediate_size", source)
              if model_type == "qwen2_moe" else 0)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _int(raw, "moe_intermediate_size", source),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": shared, "dense_layers": dense}


@dataclasses.dataclass(frozen=True, slots=True)
class GroupRouting:
    """DeepSeek-V3's "noaux_tc" routing (DeepSeek-V3, Kimi K2, GLM-4.5+): sigmoid scores plus a
    per-expert correction bias pick the top `topk_group` of `n_group` expert groups (each scored
    by its 2 best), then the top k experts in them; the picks weigh by their uncorrected scores,
    renormalised when `norm_topk_prob`, times `routed_scaling_factor`
    (`shards.layers.grouped_moe`)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float

    def check(self, experts: int, top_k: int, source: str | Path) -> None:
        """Refuse groups the experts do not split into, naming the field."""
        g, kg = self.n_group, self.topk_group
        if g < 1 or experts % g or (g > 1 and experts // g < 2):
            raise CheckpointError(f"{source}: n_group={g}: the {experts} experts must split "
                                  "into n_group groups of at least 2 (a group is scored by its "
                                  "top 2)")
        if not 0 < kg <= g:
            raise CheckpointError(f"{source}: topk_group={kg} must be in 1..n_group={g}")
        if not 0 < top_k <= experts // g * kg:
            raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be in 1.."
                                  f"{experts // g * kg} (the experts of topk_group groups)")
