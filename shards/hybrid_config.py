"""The architecture facts of the hybrid Qwen models (Qwen3.5 text, Qwen3-Next) beyond those of a
dense model: which layers are linear attention (Gated DeltaNet), the delta block's dims, the
partial rotary, and Qwen3-Next's mixture of experts. Read from an HF `config.json`; every field
we do not implement is refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from layersplit.shards.errors import CheckpointError

HYBRID_TYPES = ("qwen3_5_text", "qwen3_next")
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
_MOE = {"decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
        "num_experts_per_tok", "num_experts", "norm_topk_prob", "mlp_only_layers"}
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section",
              "mrope_interleaved"}


@dataclasses.dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        """Qwen3-Next's rule: a layer has experts unless listed in `mlp_only_layers`."""
        return layer not in self.mlp_only_layers and self.num_experts > 0 and \
            (layer + 1) % self.sparse_step == 0


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
    moe: MoESpec | None = None

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        if self.moe is not None:
            d["moe"]["mlp_only_layers"] = list(self.moe.mlp_only_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridSpec:
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        if d.get("moe") is not None:
            moe = dict(d["moe"])
            moe["mlp_only_layers"] = tuple(moe["mlp_only_layers"])
            d["moe"] = MoESpec(**moe)
        return cls(**d)


def hybrid_from_hf(raw: dict[str, Any], source: str | Path) -> HybridSpec:
    """The hybrid part of a `qwen3_5_text` / `qwen3_next` config.json; errors name the field."""
    model_type = raw["model_type"]
    from layersplit.shards.model_config import METADATA_FIELDS  # (model_config imports this module)

    known = _INERT | METADATA_FIELDS | (_MOE if model_type == "qwen3_next" else set())
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
    if rope.get("mrope_section") is not None and model_type != "qwen3_5_text":
        raise CheckpointError(f"{source}: rope_parameters.mrope_section is not supported")
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    rot = int(head_dim * factor)
    if not 0 < factor <= 1 or rot % 2:
        raise CheckpointError(f"{source}: partial_rotary_factor={factor} gives {rot} rotary "
                              f"dims of head_dim {head_dim} (must be even and > 0)")
    moe = None
    if model_type == "qwen3_next" and int(raw.get("num_experts", 512)) > 0:
        moe = MoESpec(
            num_experts=int(raw.get("num_experts", 512)),
            top_k=int(raw.get("num_experts_per_tok", 10)),
            intermediate_size=int(raw.get("moe_intermediate_size", 512)),
            shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 512)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(x) for x in raw.get("mlp_only_layers") or ()),
        )
        if not 0 < moe.top_k <= moe.num_experts:
            raise CheckpointError(f"{source}: num_experts_per_tok={moe.top_k} must be in "
                                  f"1..num_experts={moe.num_experts}")
    spec = HybridSpec(
        layer_types=tuple(types),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        partial_rotary_factor=factor,
        fused_projections=model_type == "qwen3_next",
        moe=moe,
    )
    if spec.conv_kernel < 1:
        raise CheckpointError(f"{source}: linear_conv_kernel_dim must be >= 1")
    if spec.num_value_heads % spec.num_key_heads:
        raise CheckpointError(f"{source}: linear_num_value_heads={spec.num_value_heads} is not "
                              f"a multiple of linear_num_key_heads={spec.num_key_heads}")
    return spec


def hybrid_tensor_shapes(cfg: Any, spec: HybridSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape of one layer of a hybrid model (`cfg`: ModelConfig)."""
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
    m = p + "mlp."
    if spec.moe is not None and spec.moe.is_sparse(layer):
        e, fi, fs = spec.moe.num_experts, spec.moe.intermediate_size, spec.moe.shared_intermediate_size
        shapes[m + "gate.weight"] = (e, h)
        for i in range(e):
            shapes[m + f"experts.{i}.gate_proj.weight"] = (fi, h)
            shapes[m + f"experts.{i}.up_proj.weight"] = (fi, h)
            shapes[m + f"experts.{i}.down_proj.weight"] = (h, fi)
        for name, shape in (("gate_proj", (fs, h)), ("up_proj", (fs, h)), ("down_proj", (h, fs))):
            shapes[m + f"shared_expert.{name}.weight"] = shape
        shapes[m + "shared_expert_gate.weight"] = (1, h)
    else:
        f = cfg.intermediate_size
        shapes.update({m + "gate_proj.weight": (f, h), m + "up_proj.weight": (f, h),
                       m + "down_proj.weight": (h, f)})
    return shapes
