"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) config fields, read as transformers' `Glm4MoeConfig` reads
them: the rotary on the first `partial_rotary_factor` of each head, q/k norms when
`use_qk_norm`, q/k/v biases (`attention_bias`; o_proj has none), the first
`first_k_dense_replace` layers dense, the others a mixture of `n_routed_experts` experts plus
`n_shared_experts` shared ones, routed by sigmoid scores with a per-expert correction bias
(DeepSeek-V3's "noaux_tc": the correction picks the top `topk_group` of `n_group` groups and the
top k within them, the uncorrected scores weigh the picks, renormalised when `norm_topk_prob`,
times `routed_scaling_factor`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from layersplit.shards.errors import CheckpointError
from layersplit.shards.moe_config import GroupRouting

GLM4_MOE_FIELDS = frozenset({
    "partial_rotary_factor", "use_qk_norm", "moe_intermediate_size", "num_experts_per_tok",
    "n_routed_experts", "num_local_experts", "n_shared_experts", "routed_scaling_factor",
    "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
    # checked below: only the values transformers' code implements
    "topk_method", "scoring_func", "moe_router_dtype", "decoder_sparse_step",
    # the multi-token-prediction layers past num_hidden_layers: never read (training / drafts)
    "num_nextn_predict_layers", "num_mtp_layers",
    # router losses: training only
    "output_router_logits", "router_aux_loss_coef",
})
# field -> the only value (besides absent) whose reading transformers implements
_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_router_dtype": "float32",
          "decoder_sparse_step": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class Glm4MoeSpec:
    partial_rotary_factor: float  # the rotary covers int(head_dim * this) dims of each head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _number(raw: dict[str, Any], key: str, source: str | Path, default: Any, kind=int) -> Any:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)) or value < 0:
        raise CheckpointError(f"{source}: {key}={value!r} must be a non-negative "
                              f"{'integer' if kind is int else 'number'}")
    return kind(value)


def glm4_moe_fields(raw: dict[str, Any], rope: dict[str, Any], layers: int,
                    source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` fields of a glm4_moe config that differ from the Llama reading. `rope`:
    the rope scaling as `config_from_hf` read it (its `partial_rotary_factor` is taken out)."""
    for key, want in _FIXED.items():
        if key in raw and raw[key] != want:
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not implemented for "
                                  f"model_type='glm4_moe' (only {want!r})")
    rope = dict(rope)
    factor = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"{source}: partial_rotary_factor={factor!r} must be in (0, 1]")
    experts = _number(raw, "n_routed_experts", source, raw.get("num_local_experts", 128))
    top_k = _number(raw, "num_experts_per_tok", source, 8)
    routing = GroupRouting(_number(raw, "n_group", source, 1),
                           _number(raw, "topk_group", source, 1),
                           _number(raw, "routed_scaling_factor", source, 1.0, float))
    routing.check(experts, top_k, source)
    dense = _number(raw, "first_k_dense_replace", source, 1)
    inter = _number(raw, "moe_intermediate_size", source, 1408)
    return {
        "rope_scaling": tuple(sorted((str(k), v) for k, v in rope.items())),
        "qk_norm": bool(raw.get("use_qk_norm", False)),
        "num_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": inter * _number(raw, "n_shared_experts", source, 1),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "dense_layers": tuple(range(min(dense, layers))),
        "group_routing": routing,
        "glm4_moe": Glm4MoeSpec(partial_rotary_factor=float(factor)),
    }
