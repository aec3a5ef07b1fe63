"""Which tensors a layer range needs, by canonical (Hugging Face) name, with their shapes."""

from __future__ import annotations

from collections.abc import Callable

from layersplit.shards.hybrid_config import hybrid_tensor_shapes
from layersplit.shards.mla_config import mla_tensor_shapes
from layersplit.shards.model_config import ModelConfig


def layer_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    if cfg.hybrid is not None:
        return {**hybrid_tensor_shapes(cfg, cfg.hybrid, layer), **mlp_tensor_shapes(cfg, layer)}
    if cfg.mla is not None:
        return {**mla_tensor_shapes(cfg, cfg.mla, layer), **mlp_tensor_shapes(cfg, layer)}
    h, d = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    p = f"model.layers.{layer}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (qd, h),
        p + "self_attn.k_proj.weight": (kvd, h),
        p + "self_attn.v_proj.weight": (kvd, h),
        p + "self_attn.o_proj.weight": (h, qd),
    }
    shapes.update(mlp_tensor_shapes(cfg, layer))
    if cfg.attention_bias:
        shapes[p + "self_attn.q_proj.bias"] = (qd,)
        shapes[p + "self_attn.k_proj.bias"] = (kvd,)
        shapes[p + "self_attn.v_proj.bias"] = (kvd,)
    if cfg.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    if cfg.gpt_oss is not None:  # a sink per head, a biased o_proj
        shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    if cfg.model_type == "gemma3_text":  # sandwich norms around the MLP
        shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


def mlp_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A layer's MLP: its experts (`moe_tensor_shapes`) or a dense gated MLP."""
    if cfg.is_moe(layer):
        return moe_tensor_shapes(cfg, layer)
    h, f, p = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer}.mlp."
    return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h),
            p + "down_proj.weight": (h, f)}


def moe_tensor_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse MLP's tensors. The experts are canonically 3-D (transformers' fused layout,
    gate and up apart); `shards.expert_weights` reads them from per-expert tensors too."""
    h, e, i, s = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                  cfg.shared_expert_intermediate_size)
    p = f"model.layers.{layer}.mlp."
    if cfg.gpt_oss is not None:  # transformers' layout: x @ W, gate and up interleaved
        return {p + "router.weight": (e, h), p + "router.bias": (e,),
                p + "experts.gate_up_proj": (e, h, 2 * i),
                p + "experts.gate_up_proj_bias": (e, 2 * i),
                p + "experts.down_proj": (e, i, h), p + "experts.down_proj_bias": (e, h)}
    shapes = {
        p + "gate.weight": (e, h),
        p + "experts.gate_proj": (e, i, h),
        p + "experts.up_proj": (e, i, h),
        p + "experts.down_proj": (e, h, i),
    }
    if cfg.group_routing is not None:  # DeepSeek-V3, GLM: ungated shared experts, a score bias
        shapes[p + "gate.e_score_correction_bias"] = (e,)
        if s:
            shapes.update({p + f"shared_experts.{w}_proj.weight": (s, h) for w in ("gate", "up")})
            shapes[p + "shared_experts.down_proj.weight"] = (h, s)
    elif s:
        shapes.update({
            p + "shared_expert.gate_proj.weight": (s, h),
            p + "shared_expert.up_proj.weight": (s, h),
            p + "shared_expert.down_proj.weight": (h, s),
            p + "shared_expert_gate.weight": (1, h),
        })
    return shapes


def range_tensor_shapes(cfg: ModelConfig, start: int, end: int) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape for layers [start, end) (plus embedding / head / norm).

    `lm_head.weight` is listed for the last range even when embeddings are tied; loaders then
    read it from `model.embed_tokens.weight` (see `source_name`).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    if start == 0:
        shapes["model.embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for layer in range(start, end):
        shapes.update(layer_tensor_shapes(cfg, layer))
    if end == cfg.num_layers:
        shapes["model.norm.weight"] = (cfg.hidden_size,)
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def source_name(cfg: ModelConfig, name: str) -> str:
    """The stored tensor that provides canonical `name` (tied LM head reads the embedding)."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def layer_bytes(cfg: ModelConfig, itemsize: int,
                size: Callable[[dict[str, tuple[int, ...]]], int] | None = None,
                ) -> tuple[list[int], int, int]:
    """(bytes of each layer's weights, bytes the first range alone holds (the embedding), bytes
    the last range alone holds (final norm and LM head, a copy of the embedding when tied)):
    what `--split auto` balances. A MoE layer holds all its experts. `size`: the bytes a set of
    tensors takes on the device (weights kept quantized: `quant_plan.kept_bytes`); default:
    every value at `itemsize`."""
    def plain(shapes: dict[str, tuple[int, ...]]) -> int:
        total = 0
        for shape in shapes.values():
            n = 1
            for s in shape:
                n *= s
            total += n * itemsize
        return total

    size = size or plain
    h, v = cfg.hidden_size, cfg.vocab_size
    return ([size(layer_tensor_shapes(cfg, i)) for i in range(cfg.num_layers)],
            size({"model.embed_tokens.weight": (v, h)}),
            size({"lm_head.weight": (v, h), "model.norm.weight": (h,)}))
