"""GGUF files of the hybrid Qwen models (llama.cpp archs `qwen35`, `qwen35moe`, `qwen3next`): the
config from the header and, for each canonical (HF) tensor name, the tensor of the file it comes
from and how llama.cpp's converter changed it, undone.

llama.cpp's converter (convert_hf_to_gguf: `Qwen3NextModel` and the Qwen3.5 classes below it):
- every RMSNorm weight but the delta block's output norm is stored plus 1 (llama.cpp's norms
  scale by w, transformers' zero-centred ones by 1 + w);
- `A_log` is stored as `ssm_a` = -exp(A_log), `dt_bias` as `ssm_dt.bias`, the conv weight
  (C, 1, K) squeezed to (C, K);
- Qwen3-Next's `in_proj_qkvz` (grouped per key head) is split into `attn_qkv` (q, k, v of all
  heads: the Qwen3.5 layout) and `attn_gate` (z); its `in_proj_ba` stays grouped (`ssm_ba`);
- in Qwen3.5 and Qwen3.5-MoE files, when there are more value heads than key heads, the value
  heads are reordered from grouped by key head (key head 0's v0, v1, ..., key head 1's ...) to
  tiled (each key head's v0, then each key head's v1, ...) in every tensor indexed by value
  head: the v rows of `attn_qkv` and of the conv, `attn_gate`, `ssm_beta`, `ssm_alpha`,
  `ssm_a`, `ssm_dt` and the columns of `ssm_out`;
- a layer's experts are stacked (`ffn_{gate,up,down}_exps`), its shared expert is
  `ffn_*_shexp`, the shared expert's gate `ffn_gate_inp_shexp`;
- multi-token-prediction layers, when kept, are extra blocks past the model's
  (`{arch}.nextn_predict_layers`); they are never read.
Layers hold the Qwen3.5 projection layout here (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`) whatever the arch. A header key or tensor of these archs that is not read here is
refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from layersplit.shards.errors import CheckpointError
from layersplit.shards.hybrid_config import FULL, LINEAR, HybridSpec
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.weights import range_tensor_shapes

# GGUF architecture -> HF model_type
HYBRID_ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
                        "qwen3next": "qwen3_next"}
_TILED_V_HEADS = ("qwen35", "qwen35moe")  # value heads stored tiled (see above)
_MROPE = ("qwen35", "qwen35moe")  # write rope.dimension_sections (text positions: plain rope)

# `{arch}.` header keys read (or, for the last two groups, checked and inert)
_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
    "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval", "expert_count",
    "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "expert_weights_norm", "nextn_predict_layers",
    "expert_gating_func", "rope.scaling.type",  # checked: softmax, none
}

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
# canonical name under `model.layers.N.` -> GGUF name under `blk.N.`
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",  # Qwen3-Next: half of ssm_ba
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",  # Qwen3-Next: half of ssm_ba
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight")
_BA = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")  # Qwen3-Next: ssm_ba
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _same(w: np.ndarray) -> np.ndarray:
    return w


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """Where a canonical tensor lies in the file: the GGUF tensor `name` of shape `shape`
    (outermost first), turned into the canonical tensor by `convert`."""
    name: str
    shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray] = _same


def untile_v_heads(w: np.ndarray, axis: int, key_heads: int, per_key: int,
                   head_dim: int) -> np.ndarray:
    """Value heads along `axis` from llama.cpp's tiled order back to grouped by key head (the
    inverse of the converter's `_reorder_v_heads`)."""
    shape = w.shape
    w = w.reshape(*shape[:axis], per_key, key_heads, head_dim, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(w, axis, axis + 1)).reshape(shape)


def gguf_tensor_name(canonical: str, arch: str) -> str | None:
    """The GGUF tensor that canonical tensor `canonical` comes from in a file of `arch`, or
    None if the name has no GGUF form."""
    if canonical in _GLOBAL:
        return _GLOBAL[canonical]
    m = _LAYER_NAME.match(canonical)
    if m is None or m.group(2) not in _LAYER:
        return None
    if arch == "qwen3next" and m.group(2) in _BA:
        return f"blk.{m.group(1)}.ssm_ba.weight"
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"


def tensor_source(canonical: str, shape: tuple[int, ...], cfg: ModelConfig,
                  arch: str) -> Source | None:
    """The `Source` of canonical tensor `canonical` (of `shape`) in a file of `arch`; None if
    the name has no GGUF form."""
    name = gguf_tensor_name(canonical, arch)
    if name is None:
        return None
    if canonical in _GLOBAL:
        return Source(name, shape, _minus_one if canonical == "model.norm.weight" else _same)
    rest = _LAYER_NAME.match(canonical).group(2)
    if rest in _PLUS_ONE:
        return Source(name, shape, _minus_one)
    if not rest.startswith("linear_attn."):
        return Source(name, shape)
    spec = cfg.hybrid
    hk, hv, dk, dv = (spec.num_key_heads, spec.num_value_heads, spec.key_head_dim,
                      spec.value_head_dim)
    r = hv // hk
    tiled = arch in _TILED_V_HEADS and hk != hv

    def untile(axis: int, head_dim: int, start: int = 0) -> Callable[[np.ndarray], np.ndarray]:
        """Untile the value heads of `w` along `axis` from index `start` on."""
        def f(w: np.ndarray) -> np.ndarray:
            if not tiled:
                return w
            head, tail = np.split(w, [start], axis=axis)
            return np.concatenate([head, untile_v_heads(tail, axis, hk, r, head_dim)], axis)
        return f

    if arch == "qwen3next" and rest in _BA:  # rows grouped per key head: [b (r), a (r)]
        half = _BA.index(rest)
        return Source(name, (2 * hv, shape[1]),
                      lambda w: w.reshape(hk, 2, r, -1)[:, half].reshape(hv, -1))
    if rest == "linear_attn.in_proj_qkv.weight":
        return Source(name, shape, untile(0, dv, 2 * hk * dk))
    if rest == "linear_attn.in_proj_z.weight":
        return Source(name, shape, untile(0, dv))
    if rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        return Source(name, shape, untile(0, 1))
    if rest == "linear_attn.dt_bias":
        return Source(name, shape, untile(0, 1))
    if rest == "linear_attn.A_log":  # stored as -exp(A_log)
        return Source(name, shape, lambda w: untile(0, 1)(np.log(-w)))
    if rest == "linear_attn.conv1d.weight":  # (C, 1, K) stored as (C, K)
        c, _, k = shape
        return Source(name, (c, k), lambda w: untile(0, dv, 2 * hk * dk)(w).reshape(c, 1, k))
    if rest == "linear_attn.out_proj.weight":
        return Source(name, shape, untile(1, dv))
    return Source(name, shape)


def _minus_one(w: np.ndarray) -> np.ndarray:
    return w - np.float32(1.0)


def hybrid_config(f: Any) -> ModelConfig:
    """The `ModelConfig` of a hybrid GGUF (`f`: a `GGUFFile` whose `arch` is hybrid): sizes
    from the header, each layer's kind from its tensors (checked against
    `full_attention_interval`), experts where a layer has a router (`ffn_gate_inp`)."""
    a, path = f.arch, f.path
    for key in f.header.fields:
        if key.startswith(f"{a}.") and key[len(a) + 1:] not in _KEYS | (
                {"rope.dimension_sections"} if a in _MROPE else set()):
            raise CheckpointError(f"{path}: GGUF field {key!r} is not supported for {a} "
                                  "(layersplit does not implement it)")
    scaling = f.field(f"{a}.rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise CheckpointError(f"{path}: {a}.rope.scaling.type={scaling!r} is not supported")
    gating = f.field(f"{a}.expert_gating_func", None)
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise CheckpointError(f"{path}: {a}.expert_gating_func={gating!r} is not supported "
                              "(only 1, softmax)")
    mtp = int(f.field(f"{a}.nextn_predict_layers", 0))
    layers = int(f.field(f"{a}.block_count")) - mtp
    types = tuple(_layer_kind(f, i) for i in range(layers))
    every = f.field(f"{a}.full_attention_interval", None)
    if every is not None and types != tuple(
            LINEAR if (i + 1) % int(every) else FULL for i in range(layers)):
        raise CheckpointError(f"{path}: {a}.full_attention_interval={every} disagrees with "
                              f"the layers' tensors ({', '.join(t[0] for t in types)})")
    heads = int(f.field(f"{a}.attention.head_count"))
    hidden = int(f.field(f"{a}.embedding_length"))
    head_dim = int(f.field(f"{a}.attention.key_length", 0) or hidden // heads)
    if int(f.field(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: {a}.attention.value_length differs from key_length "
                              "(not supported)")
    rot = int(f.field(f"{a}.rope.dimension_count"))
    hv = int(f.field(f"{a}.ssm.time_step_rank"))
    inner = int(f.field(f"{a}.ssm.inner_size"))
    if hv <= 0 or inner % hv:
        raise CheckpointError(f"{path}: {a}.ssm.inner_size={inner} is not a multiple of "
                              f"{a}.ssm.time_step_rank={hv}")
    spec = HybridSpec(
        layer_types=types,
        conv_kernel=int(f.field(f"{a}.ssm.conv_kernel")),
        key_head_dim=int(f.field(f"{a}.ssm.state_size")),
        value_head_dim=inner // hv,
        num_key_heads=int(f.field(f"{a}.ssm.group_count")),
        num_value_heads=hv,
        partial_rotary_factor=rot / head_dim,
        fused_projections=False,
    )
    if int(head_dim * spec.partial_rotary_factor) != rot:  # (rotary_dim's rounding)
        raise CheckpointError(f"{path}: {a}.rope.dimension_count={rot} of head dim {head_dim} "
                              "is not supported (no partial_rotary_factor gives it back)")
    if spec.num_value_heads % spec.num_key_heads or not 0 < rot <= head_dim or rot % 2:
        raise CheckpointError(f"{path}: {a}.ssm.time_step_rank={hv} must be a multiple of "
                              f"{a}.ssm.group_count={spec.num_key_heads} and "
                              f"{a}.rope.dimension_count={rot} even, in 2..{head_dim}")
    tok_embd = f.tensors.get("token_embd.weight")
    vocab = f.field(f"{a}.vocab_size", None)
    if vocab is None:
        if tok_embd is None:
            raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
        vocab = int(tok_embd.shape[-1])
    first_attn = next((i for i, t in enumerate(types) if t == FULL), None)
    moe = _moe_fields(f, layers)
    needs_ffn = not moe or bool(moe["dense_layers"])  # some layer has a dense MLP
    eos = f.field("tokenizer.ggml.eos_token_id", None)
    cfg = ModelConfig(
        model_type=HYBRID_ARCHITECTURES[a],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f.field(f"{a}.feed_forward_length") if needs_ffn
                              else f.field(f"{a}.feed_forward_length", 0)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(f.field(f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(f.field(f"{a}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(f.field(f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(f.field(f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias=first_attn is not None and f"blk.{first_attn}.attn_q.bias" in f.tensors,
        qk_norm=True,
        bos_token_id=f.field("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        hybrid=spec,
        **moe,
    )
    _refuse_unread_tensors(f, cfg, mtp)
    return cfg


def _layer_kind(f: Any, layer: int) -> str:
    if f"blk.{layer}.ssm_a" in f.tensors:
        return LINEAR
    if f"blk.{layer}.attn_q.weight" in f.tensors:
        return FULL
    raise CheckpointError(f"{f.path}: block {layer} has neither 'blk.{layer}.ssm_a' (linear "
                          f"attention) nor 'blk.{layer}.attn_q.weight' (full attention)")


def _moe_fields(f: Any, layers: int) -> dict[str, Any]:
    a = f.arch
    experts = int(f.field(f"{a}.expert_count", 0) or 0)
    if not experts:
        return {}
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    shexp = f.tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight") if sparse else None
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(f.field(f"{a}.expert_used_count")),
        "moe_intermediate_size": int(f.field(f"{a}.expert_feed_forward_length")),
        "norm_topk_prob": bool(f.field(f"{a}.expert_weights_norm", True)),
        "shared_expert_intermediate_size": 0 if shexp is None else int(shexp.shape[-1]),
        "dense_layers": tuple(i for i in range(layers) if i not in sparse),
    }


def _refuse_unread_tensors(f: Any, cfg: ModelConfig, mtp: int) -> None:
    """A tensor of the file that no layer range reads (past the MTP blocks) would be a part of
    the model this code does not implement: refused by name."""
    read = {"token_embd.weight"}
    for name, shape in range_tensor_shapes(cfg, 0, cfg.num_layers).items():
        src = tensor_source(name, shape, cfg, f.arch)
        if src is not None:
            read.add(src.name)
    for name in f.tensors:
        m = re.match(r"^blk\.(\d+)\.", name)
        if name in read or (m is not None and mtp and int(m.group(1)) >= cfg.num_layers):
            continue
        raise CheckpointError(f"{f.path}: tensor {name!r} is not supported for {f.arch} "
                              "(layersplit does not implement it)")
