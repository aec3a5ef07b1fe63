"""The DeepSeek-V3 family's config fields (`deepseek_v3`, and Kimi K2's `kimi_k2`, the same
architecture), read as transformers' `DeepseekV3Config` reads them.

Multi-head latent attention (`MLASpec`): queries through a low-rank `q_lora_rank` bottleneck (or
one `q_proj` when it is null), keys and values from one latent of `kv_lora_rank` values per token
plus a `qk_rope_head_dim` rotary key shared by all heads. The MoE (`GroupRouting` and the common
`ModelConfig` MoE fields): sigmoid router scores plus `e_score_correction_bias` pick `topk_group`
of `n_group` expert groups, then the top k experts in them ("noaux_tc"); the weights are the
plain sigmoid scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`; the
`n_shared_experts` always run. Layers below `first_k_dense_replace` are dense.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from layersplit.shards.errors import CheckpointError

MLA_TYPES = ("deepseek_v3", "kimi_k2")

# Fields read here (beyond the common ones of `shards.model_config.COMMON_FIELDS`).
_READ = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "rope_interleave", "n_routed_experts", "num_local_experts",
    "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "scoring_func",
    "topk_method", "moe_layer_freq",
})
# No effect on outputs at inference: router losses (training), expert parallelism (`ep_size`:
# how the original code spread experts over GPUs) and the multi-token-prediction module
# (`num_nextn_predict_layers`: a layer past the last, whose tensors are never read).
_INERT = frozenset({"aux_loss_alpha", "seq_aux", "output_router_logits", "router_aux_loss_coef",
                    "ep_size", "num_nextn_predict_layers", "num_mtp_layers"})
MLA_FIELDS = _READ | _INERT
# fields whose only implemented value is this one
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


@dataclasses.dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention's dims. An MLA layer caches, per token, the normed latent
    (`kv_lora_rank`) and the rotated shared key (`qk_rope_head_dim`): its latent row."""

    q_lora_rank: int  # 0: queries from one q_proj (q_lora_rank null)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dims stored as interleaved pairs (DeepSeek's weights)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared

    @property
    def latent_width(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True, slots=True)
class GroupRouting:
    """Sigmoid routing within the top `topk_group` of `n_group` expert groups ("noaux_tc")."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float


def _int(raw: dict[str, Any], key: str, source: str | Path, default: Any = ...,
         low: int = 0) -> int:
    value = raw.get(key, default)
    if value is ...:
        raise CheckpointError(f"{source}: required field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckpointError(f"{source}: {key}={value!r} must be an integer >= {low}")
    return value


def _softmax_scale(raw: dict[str, Any], qk_head_dim: int) -> float:
    """transformers' `yarn_apply_mscale`: a scaled rope with `mscale_all_dim` multiplies the
    score scale by mscale(factor, mscale_all_dim) ** 2."""
    scale = qk_head_dim ** -0.5
    rope = {**(raw.get("rope_parameters") or {}), **(raw.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


def mla_fields(raw: dict[str, Any], layers: int, source: str | Path) -> dict[str, Any]:
    """The `ModelConfig` fields of a DeepSeek-V3-family config: `mla`, `group_routing`, the
    rotary head dim and the MoE fields; errors name the field."""
    for key, want in _FIXED.items():
        if key in raw and raw[key] != want:
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (only "
                                  f"{want!r})")
    q_lora = raw.get("q_lora_rank")
    q_lora = 0 if q_lora is None else _int(raw, "q_lora_rank", source, low=1)
    nope = _int(raw, "qk_nope_head_dim", source, low=1)
    rope_dim = _int(raw, "qk_rope_head_dim", source, low=2)
    if rope_dim % 2:
        raise CheckpointError(f"{source}: qk_rope_head_dim={rope_dim} must be even")
    for key, want in (("head_dim", rope_dim), ("qk_head_dim", nope + rope_dim)):
        if raw.get(key) not in (None, want):  # (transformers derives both and saves them)
            raise CheckpointError(f"{source}: {key}={raw[key]!r} disagrees with the MLA dims "
                                  f"(expected {want})")
    if raw.get("num_key_value_heads") not in (None, raw.get("num_attention_heads")):
        raise CheckpointError(f"{source}: num_key_value_heads={raw['num_key_value_heads']!r}: "
                              "MLA has one latent for all heads (expected num_attention_heads)")
    mla = MLASpec(
        q_lora_rank=q_lora, kv_lora_rank=_int(raw, "kv_lora_rank", source, low=1),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=_int(raw, "v_head_dim", source, low=1),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=_softmax_scale(raw, nope + rope_dim))
    experts_key = "n_routed_experts" if "n_routed_experts" in raw else "num_local_experts"
    experts = _int(raw, experts_key, source, low=1)
    top_k = _int(raw, "num_experts_per_tok", source, low=1)
    n_group = _int(raw, "n_group", source, low=1)
    topk_group = _int(raw, "topk_group", source, low=1)
    if experts % n_group or topk_group > n_group:
        raise CheckpointError(f"{source}: n_group={n_group}, topk_group={topk_group}: the "
                              f"{experts} experts must split into n_group groups, of which "
                              "topk_group are kept")
    if experts // n_group < 2 and n_group > 1:  # (transformers scores a group by its top 2)
        raise CheckpointError(f"{source}: n_group={n_group} leaves fewer than 2 experts a group")
    if top_k > experts // n_group * topk_group:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} is more than the "
                              f"{experts // n_group * topk_group} experts of topk_group groups")
    scaling = raw.get("routed_scaling_factor", 1.0)
    if not isinstance(scaling, int | float) or isinstance(scaling, bool):
        raise CheckpointError(f"{source}: routed_scaling_factor={scaling!r} must be a number")
    first_dense = _int(raw, "first_k_dense_replace", source, 0)
    shared = _int(raw, "n_shared_experts", source, 0)
    inter = _int(raw, "moe_intermediate_size", source, low=1)
    return {
        "head_dim": rope_dim,  # the rotary's width (as transformers' config.head_dim)
        "mla": mla,
        "group_routing": GroupRouting(n_group, topk_group, float(scaling)),
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": inter * shared,
        "dense_layers": tuple(range(min(first_dense, layers))),
    }


def mla_tensor_shapes(cfg: Any, mla: MLASpec, layer: int) -> dict[str, tuple[int, ...]]:
    """An MLA layer's norms and attention tensors, by transformers' names (`cfg`: its
    `ModelConfig`)."""
    h, n = cfg.hidden_size, cfg.num_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        a + "kv_a_proj_with_mqa.weight": (mla.latent_width, h),
        a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        a + "kv_b_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        a + "o_proj.weight": (h, n * mla.v_head_dim),
    }
    if mla.q_lora_rank:
        shapes.update({a + "q_a_proj.weight": (mla.q_lora_rank, h),
                       a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                       a + "q_b_proj.weight": (n * qk, mla.q_lora_rank)})
    else:
        shapes[a + "q_proj.weight"] = (n * qk, h)
    if cfg.attention_bias:  # (transformers biases these three)
        shapes[a + "kv_a_proj_with_mqa.bias"] = (mla.latent_width,)
        shapes[a + "o_proj.bias"] = (h,)
        if mla.q_lora_rank:
            shapes[a + "q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes
