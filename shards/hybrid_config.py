"""The architecture facts of the hybrid Qwen models (Qwen3.5 text, Qwen3.5-MoE text,
Qwen3-Next) beyond those of a dense model: which layers are linear attention (Gated DeltaNet),
the delta block's dims and the partial rotary (`HybridSpec`), and the mixture of experts of
Qwen3-Next and Qwen3.5-MoE (`hybrid_moe_fields`: the `ModelConfig` MoE fields, the same as the
MoE families'). Read from an HF `config.json`; every field we do not implement is refused by
name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from layersplit.shards.config_fields import METADATA_FIELDS
from layersplit.shards.errors import CheckpointError

HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")  # every layer's MLP may be sparse
LINEAR, FULL = "linear_attention", "full_attention"
# config.json fields that change nothing at inference, or that we implement below
_INERT = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
    "output_router_logits", "router_aux_loss_coef", "keys_to_ignore_at_inference",
    "tie_word_embeddings", "max_position_embeddings", "vocab_size", "hidden_size",
    "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act",
    "attention_bias", "layer_types", "full_attention_interval", "partial_rotary_factor",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads",
    # multi-token-prediction heads: separate tensors (mtp.*) that are never read
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
}
# the MoE fields each family reads (Qwen3.5-MoE: every layer sparse, top k always renormalised)
_MOE = {
    "qwen3_next": {"decoder_sparse_step", "moe_intermediate_size",
                   "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts",
                   "norm_topk_prob", "mlp_only_layers"},
    "qwen3_5_moe_text": {"moe_intermediate_size", "shared_expert_intermediate_size",
                         "num_experts_per_tok", "num_experts"},
}
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section",
              "mrope_interleaved"}


@dataclasses.dataclass(frozen=True, slots=True)
class HybridSpec:
    layer_types: tuple[str, ...]
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    partial_rotary_factor: float
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba layout

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    @property
    def conv_dim(self) -> int:
        return (2 * self.num_key_heads * self.key_head_dim
                + self.num_value_heads * self.value_head_dim)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridSpec:
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def hybrid_from_hf(raw: dict[str, Any], source: str | Path) -> HybridSpec:
    """The hybrid part of a `qwen3_5_text` / `qwen3_5_moe_text` / `qwen3_next` config.json;
    errors name the field."""
    model_type = raw["model_type"]
    known = _INERT | METADATA_FIELDS | _MOE.get(model_type, set())
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise CheckpointError(f"{source}: field {unknown[0]!r} of {model_type} is not supported "
                              f"(layersplit does not implement it)")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported "
                              "(only 'silu')")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % every else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in (LINEAR, FULL) for t in types):
        raise CheckpointError(f"{source}: layer_types must list {layers} entries, each "
                              f"{LINEAR!r} or {FULL!r}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    bad = sorted(set(rope) - _ROPE_KEYS)
    if bad:
        raise CheckpointError(f"{source}: rope_parameters.{bad[0]} is not supported")
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: rope_parameters.rope_type={rope['rope_type']!r} is "
                              f"not supported for {model_type} (only 'default')")
    if rope.get("mrope_section") is not None and model_type == "qwen3_next":
        raise CheckpointError(f"{source}: rope_parameters.mrope_section is not supported")
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    rot = int(head_dim * factor)
    if not 0 < factor <= 1 or rot % 2:
        raise CheckpointError(f"{source}: partial_rotary_factor={factor} gives {rot} rotary "
                              f"dims of head_dim {head_dim} (must be even and > 0)")
    spec = HybridSpec(
        layer_types=tuple(types),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        partial_rotary_factor=factor,
        fused_projections=model_type == "qwen3_next",
    )
    if spec.conv_kernel < 1:
        raise CheckpointError(f"{source}: linear_conv_kernel_dim must be >= 1")
    if spec.num_value_heads % spec.num_key_heads:
        raise CheckpointError(f"{source}: linear_num_value_heads={spec.num_value_heads} is not "
                              f"a multiple of linear_num_key_heads={spec.num_key_heads}")
    return spec


def _count(raw: dict[str, Any], key: str, default: int, source: str | Path) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{source}: {key}={value!r} must be a non-negative integer")
    return value


def hybrid_moe_fields(raw: dict[str, Any], layers: int, source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` MoE fields of a hybrid config, read as transformers reads them (its
    defaults where a field is absent); none for a dense family or `num_experts: 0`.

    Qwen3-Next: softmax top-k routing, renormalised when `norm_topk_prob`; a layer is sparse
    unless listed in `mlp_only_layers` or off the `decoder_sparse_step` stride. Qwen3.5-MoE:
    every layer sparse, the top k always renormalised. Both add a shared expert gated by a
    sigmoid."""
    model_type = raw["model_type"]
    if model_type not in MOE_TYPES:
        return {}
    next_ = model_type == "qwen3_next"
    experts = _count(raw, "num_experts", 512 if next_ else 256, source)
    if not experts:  # transformers builds every layer dense
        return {}
    top_k = _count(raw, "num_experts_per_tok", 10 if next_ else 8, source)
    if not 0 < top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be in "
                              f"1..num_experts={experts}")
    dense: tuple[int, ...] = ()
    if next_:
        step = _count(raw, "decoder_sparse_step", 1, source)
        only = raw.get("mlp_only_layers") or []
        if step < 1 or not isinstance(only, list) or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise CheckpointError(f"{source}: decoder_sparse_step={step!r} must be >= 1 and "
                                  f"mlp_only_layers={only!r} a list of layer indices")
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _count(raw, "moe_intermediate_size", 512, source),
        "shared_expert_intermediate_size":
            _count(raw, "shared_expert_intermediate_size", 512, source),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)) if next_ else True,
        "dense_layers": dense,
    }


def hybrid_tensor_shapes(cfg: Any, spec: HybridSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape of one layer of a hybrid model (`cfg`: ModelConfig), its
    MLP left out (`shards.weights.layer_tensor_shapes` adds it, dense or experts)."""
    h, p = cfg.hidden_size, f"model.layers.{layer}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }
    if spec.is_linear(layer):
        a = p + "linear_attn."
        kd, vd = spec.num_key_heads * spec.key_head_dim, spec.num_value_heads * spec.value_head_dim
        hv = spec.num_value_heads
        if spec.fused_projections:
            shapes[a + "in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
            shapes[a + "in_proj_ba.weight"] = (2 * hv, h)
        else:
            shapes[a + "in_proj_qkv.weight"] = (2 * kd + vd, h)
            shapes[a + "in_proj_z.weight"] = (vd, h)
            shapes[a + "in_proj_b.weight"] = (hv, h)
            shapes[a + "in_proj_a.weight"] = (hv, h)
        shapes[a + "conv1d.weight"] = (spec.conv_dim, 1, spec.conv_kernel)
        shapes[a + "dt_bias"] = (hv,)
        shapes[a + "A_log"] = (hv,)
        shapes[a + "norm.weight"] = (spec.value_head_dim,)
        shapes[a + "out_proj.weight"] = (h, vd)
    else:
        a, d = p + "self_attn.", cfg.head_dim
        qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
        shapes[a + "q_proj.weight"] = (2 * qd, h)
        shapes[a + "k_proj.weight"] = (kvd, h)
        shapes[a + "v_proj.weight"] = (kvd, h)
        shapes[a + "o_proj.weight"] = (h, qd)
        if cfg.attention_bias:
            for name, n in (("q_proj", 2 * qd), ("k_proj", kvd), ("v_proj", kvd), ("o_proj", h)):
                shapes[a + name + ".bias"] = (n,)
        shapes[a + "q_norm.weight"] = (d,)
        shapes[a + "k_norm.weight"] = (d,)
    return shapes
