"""The architecture facts a layer range needs, read from an HF `config.json` or a GGUF header."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from layersplit.shards.config_fields import METADATA_FIELDS
from layersplit.shards.errors import CheckpointError
from layersplit.shards.gemma_config import GEMMA_FIELDS, gemma_fields
from layersplit.shards.glm4_moe_config import GLM4_MOE_FIELDS, Glm4MoeSpec, glm4_moe_fields
from layersplit.shards.gpt_oss_config import GPT_OSS_FIELDS, GptOssSpec, gpt_oss_fields
from layersplit.shards.hybrid_config import (
    HYBRID_TYPES,
    HybridSpec,
    hybrid_from_hf,
    hybrid_moe_fields,
)
from layersplit.shards.mla_config import MLA_FIELDS, MLA_TYPES, MLASpec, mla_fields
from layersplit.shards.moe_config import MOE_FAMILY_FIELDS, GroupRouting, moe_fields
from layersplit.shards.quant_config import quant_scheme

# model_type -> (q/k/v bias, q/k RMSNorm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    "qwen2_moe": (True, False),
    "mixtral": (False, False),
    "gemma3_text": (False, True),
    **{t: (False, False) for t in MLA_TYPES},
    "glm4_moe": (False, False),
    "gpt_oss": (True, False),
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# the rope_scaling keys each type implements (others are refused by name)
ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "original_max_position_embeddings", "truncate"}),
    "dynamic": frozenset({"factor"}),
}
LAYER_TYPES = ("full_attention", "sliding_attention")

# families whose q/k/v bias transformers fixes, whatever `attention_bias` says
FIXED_QKV_BIAS = {"mistral": False, "mixtral": False, "qwen2": True}
# families where transformers' `attention_bias` also biases o_proj (not implemented here)
O_PROJ_BIAS = frozenset({"llama", "qwen3", "qwen3_moe", "gemma3_text"})

# Fields read by `config_from_hf` for every family (their values are checked there).
COMMON_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "hidden_act", "mlp_bias", "pretraining_tp", "rope_interleaved",
})
# Family-specific fields the runtime implements.
FAMILY_FIELDS: dict[str, frozenset[str]] = {
    "llama": frozenset(),
    "mistral": frozenset({"sliding_window", "layer_types"}),
    "qwen2": frozenset({"sliding_window", "use_sliding_window", "max_window_layers",
                        "layer_types"}),
    "qwen3": frozenset({"sliding_window", "use_sliding_window", "max_window_layers",
                        "layer_types"}),
    **MOE_FAMILY_FIELDS,
    "gemma3_text": GEMMA_FIELDS,
    **{t: MLA_FIELDS for t in MLA_TYPES},
    "glm4_moe": GLM4_MOE_FIELDS,
    "gpt_oss": GPT_OSS_FIELDS,
}
# families whose own reader (`shards.glm4_moe_config`, `shards.gpt_oss_config`) sets their
# windows, experts and rope (`config_from_hf`)
_OWN_READERS = {"glm4_moe": glm4_moe_fields, "gpt_oss": gpt_oss_fields}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention kind (HF's `layer_types`); empty: every layer full attention.
    # "sliding_attention" layers attend the last `sliding_window` positions only.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Mixture of experts (`shards.moe_config`); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's hidden width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    # Qwen2-MoE's sigmoid-gated shared expert (with `group_routing`: the ungated shared experts,
    # one MLP this wide); 0: none
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model whose MLP is dense
    # Gemma 3 (`shards.gemma_config`)
    hidden_act: str = "silu"  # the MLP's activation: silu or gelu_pytorch_tanh
    local_rope_theta: float | None = None  # sliding layers' rope base (unscaled); None: as full
    attn_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    hybrid: HybridSpec | None = None  # Qwen3.5 / Qwen3-Next: linear-attention layers and more
    # DeepSeek-V3 (`shards.mla_config`): latent attention (head_dim is then the rotary's width)
    mla: MLASpec | None = None
    # DeepSeek-V3 and GLM-4.5+: grouped sigmoid routing ("noaux_tc"; `shards.moe_config`), its
    # ungated shared experts `shared_expert_intermediate_size` wide
    group_routing: GroupRouting | None = None
    glm4_moe: Glm4MoeSpec | None = None  # GLM-4.5+: partial rotary
    gpt_oss: GptOssSpec | None = None  # gpt-oss: attention sinks, its experts' clamped SwiGLU

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )
        for key in self.rope_params if self.hybrid is None else ():  # hybrids check theirs
            if key not in ROPE_KEYS[self.rope_type] | {"rope_type", "type"}:
                raise CheckpointError(f"rope_scaling.{key} is not implemented for rope_type="
                                      f"{self.rope_type!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise CheckpointError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_layers} layers")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise CheckpointError(f"layer_types: {t!r} is not supported (supported: "
                                      f"{', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise CheckpointError(f"sliding_window={self.sliding_window!r}: sliding-attention "
                                  "layers need a positive window")

    def window(self, layer: int) -> int | None:
        """The attention window of global layer `layer` (keys q - window < k <= q), or None
        for full causal attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe(self, layer: int) -> bool:
        """Whether global layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rotary_dim(self) -> int:
        """The dims of each head the rotary turns (the first ones; GLM: a fraction)."""
        if self.glm4_moe is not None:
            return int(self.head_dim * self.glm4_moe.partial_rotary_factor)
        return self.head_dim

    @property
    def rope_type(self) -> str:
        d = dict(self.rope_scaling)
        return str(d.get("rope_type", d.get("type", "default")))

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict (`from_dict` reads it back). Fields added since the first
        version are left out while unset, so a model's prefix-cache fingerprint (a hash of this
        dict) is the same as before they existed and its cache entries stay valid."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = [list(kv) for kv in self.rope_scaling]
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["dense_layers"] = list(self.dense_layers)
        if d["hidden_act"] == "silu":
            del d["hidden_act"]
        for name in ("layer_types", "sliding_window", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "norm_topk_prob",
                     "shared_expert_intermediate_size", "dense_layers", "local_rope_theta",
                     "attn_scale", "final_logit_softcap"):
            if not d[name]:
                del d[name]
        if self.hybrid is not None:
            d["hybrid"] = self.hybrid.to_dict()
        else:
            del d["hybrid"]
        for name in ("mla", "group_routing"):
            if d[name] is None:
                del d[name]
        for name in ("glm4_moe", "gpt_oss"):
            spec = getattr(self, name)
            if spec is None:
                del d[name]
            else:
                d[name] = spec.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = tuple((str(k), v) for k, v in d.get("rope_scaling", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["dense_layers"] = tuple(d.get("dense_layers", ()))
        if d.get("hybrid") is not None:
            d["hybrid"] = HybridSpec.from_dict(d["hybrid"])
        if d.get("mla") is not None:
            d["mla"] = MLASpec(**d["mla"])
        if d.get("group_routing") is not None:
            d["group_routing"] = GroupRouting(**d["group_routing"])
        if d.get("glm4_moe") is not None:
            d["glm4_moe"] = Glm4MoeSpec(**d["glm4_moe"])
        if d.get("gpt_oss") is not None:
            d["gpt_oss"] = GptOssSpec(**d["gpt_oss"])
        return cls(**d)

    @property
    def kv_row(self) -> tuple[int, int]:
        """(heads, dim) of one token's K row, and of its V row, in one layer's KV cache. An MLA
        layer caches one latent row per token (`MLASpec.latent_width` values), kept as two
        halves in the cache's K and V tensors (a column of padding when the width is odd), so
        every cache tier (paged pool, host swap, snapshots, disk) carries it unchanged."""
        if self.mla is not None:
            return 1, -(-self.mla.latent_width // 2)
        return self.num_kv_heads, self.head_dim

    def kv_bytes_per_token(self, layers: int, itemsize: int) -> int:
        heads, dim = self.kv_row
        return 2 * layers * heads * dim * itemsize


def _eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(raw: dict[str, Any], source: str | Path, strict: bool = True) -> ModelConfig:
    """Build a ModelConfig from the dict of an HF `config.json`; errors name the field and file.

    `strict`: refuse every field the family does not implement (`check_fields`). Only a
    speculative draft's config is read with strict=False: a field its code ignores can cost
    acceptance, never a wrong token (the target verifies every one)."""
    model_type = raw.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_moe") and isinstance(raw.get("text_config"), dict):
        raise CheckpointError(
            f"{source}: a Qwen3.5 vision-language checkpoint (model_type {model_type!r}, "
            "tensors under model.language_model.) is not supported yet; use a text-only "
            f"checkpoint (model_type '{model_type}_text', as Qwen3_5ForCausalLM / "
            "Qwen3_5MoeForCausalLM save it)")
    # hybrid families check their own fields (`shards.hybrid_config`), strictly always
    hybrid = hybrid_from_hf(raw, source) if model_type in HYBRID_TYPES else None
    if model_type not in FAMILIES and hybrid is None:
        raise CheckpointError(
            f"{source}: model_type={model_type!r} is not supported "
            f"(supported: {', '.join(sorted((*FAMILIES, *HYBRID_TYPES)))})"
        )
    bias_default, qk_norm = FAMILIES[model_type] if hybrid is None else (False, True)

    def need(key: str) -> Any:
        if key not in raw:
            raise CheckpointError(f"{source}: required field {key!r} is missing")
        return raw[key]

    if strict and hybrid is None:
        check_fields(raw, model_type, source)
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    rope = raw.get("rope_scaling") or {}
    if "rope_parameters" in raw and isinstance(raw["rope_parameters"], dict):
        rope = {**raw["rope_parameters"], **rope}
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    fields = dict(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        # (Qwen3.5-MoE has no dense MLP, and no intermediate_size)
        intermediate_size=int(need("intermediate_size") if model_type != "qwen3_5_moe_text"
                              else raw.get("intermediate_size") or 0),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=(FIXED_QKV_BIAS[model_type] if model_type in FIXED_QKV_BIAS else
                        bool(raw.get("qkv_bias" if model_type == "qwen2_moe" else
                                     "attention_bias", bias_default))),
        qk_norm=qk_norm,
        rope_scaling=tuple(sorted((str(k), v) for k, v in rope.items())),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_list(raw.get("eos_token_id")),
        **(_windows(raw, model_type, int(need("num_hidden_layers")), source)
           if hybrid is None and model_type not in ("gemma3_text", *_OWN_READERS) else
           {"hybrid": hybrid} if hybrid is not None else {}),
        **(moe_fields(raw, model_type, int(need("num_hidden_layers")), source) if hybrid is None
           else hybrid_moe_fields(raw, int(need("num_hidden_layers")), source)),
    )
    if model_type == "gemma3_text":  # its ropes, windows and scales (`shards.gemma_config`)
        fields.update(gemma_fields(raw, int(need("num_hidden_layers")), source))
    if model_type in MLA_TYPES:  # latent attention, grouped routing (`shards.mla_config`)
        fields.update(mla_fields(raw, int(need("num_hidden_layers")), source))
    if model_type in _OWN_READERS:  # (`shards.glm4_moe_config`, `shards.gpt_oss_config`)
        fields.update(_OWN_READERS[model_type](raw, rope, int(need("num_hidden_layers")), source))
    try:
        return ModelConfig(**fields)
    except CheckpointError as e:  # the dataclass's own checks: name the file too
        raise CheckpointError(f"{source}: {e}") from None


def check_fields(raw: dict[str, Any], model_type: str, source: str | Path) -> None:
    """Refuse, by name, a config field this family's code does not implement: a runtime that
    ignored one (a logit soft-cap, a window, a bias) would answer with silently wrong tokens."""
    known = METADATA_FIELDS | COMMON_FIELDS | FAMILY_FIELDS[model_type]
    if "quantization_config" not in known:  # (gpt_oss reads its own: MXFP4 experts)
        quant_scheme(raw, source)  # an FP8 or int4 checkpoint's, or refused by name
        known = known | {"quantization_config"}
    for key, value in raw.items():
        if key not in known:
            raise CheckpointError(
                f"{source}: config field {key!r}={value!r} is not implemented for "
                f"model_type={model_type!r}; layersplit refuses it rather than risk wrong "
                "output (remove it from config.json only if it does not change the model)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if model_type in O_PROJ_BIAS and raw.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true also biases o_proj in "
                              f"transformers' {model_type}, which is not implemented")
    for key, harmless in (("mlp_bias", (None, False)), ("pretraining_tp", (None, 1)),
                          ("rope_interleaved", (None, False))):
        if raw.get(key) not in harmless:
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported")


def _windows(raw: dict[str, Any], model_type: str, layers: int,
             source: str | Path) -> dict[str, Any]:
    """`layer_types` and `sliding_window` as transformers derives them: Mistral windows every
    layer; Qwen2/Qwen3 window layers >= `max_window_layers` when `use_sliding_window`; an
    explicit `layer_types` wins."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not raw.get(
            "use_sliding_window", False):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window <= 0):
        raise CheckpointError(f"{source}: sliding_window={window!r} must be a positive integer")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise CheckpointError(f"{source}: layer_types must be a list of strings")
        for t in types:
            if t not in LAYER_TYPES:
                raise CheckpointError(f"{source}: layer_types: {t!r} is not supported for "
                                      f"model_type={model_type!r} (supported: "
                                      f"{', '.join(LAYER_TYPES)})")
        if model_type in ("mistral", "mixtral"):
            types = None  # transformers' Mistral and Mixtral window every layer regardless
    if types is not None:
        if "sliding_attention" not in types:
            return {}  # all full attention: the same config as no layer_types at all
        if window is None:
            raise CheckpointError(f"{source}: layer_types has sliding_attention layers but "
                                  "sliding_window is not set")
        return {"layer_types": tuple(types), "sliding_window": window}
    if window is None:
        return {}
    if model_type in ("mistral", "mixtral", "qwen3_moe"):  # every layer, as transformers
        first = 0
    elif model_type == "qwen2_moe":  # transformers windows the even layers below the bound
        bound = int(raw.get("max_window_layers", 28))
        types = tuple("sliding_attention" if i % 2 == 0 and i < bound else "full_attention"
                      for i in range(layers))
    else:
        first = int(raw.get("max_window_layers", 28))
    if model_type != "qwen2_moe":
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(layers))
    if "sliding_attention" not in types:
        return {}
    return {"layer_types": types, "sliding_window": window}


def read_hf_config(folder: Path, strict: bool = True) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config_from_hf(raw, path, strict)


def context_limit_error(cfg: ModelConfig, max_len: int) -> str | None:
    """Why a KV cache of `max_len` positions cannot be served exactly, or None.

    Dynamic NTK rope recomputes its frequencies in transformers from the longest position of
    each forward call once it passes max_position_embeddings, so the keys past it depend on how
    the sequence was split into calls (a whole prompt at once or chunk by chunk, one token or a
    verify block); below it, it is the default rope. Those positions are refused."""
    if cfg.rope_type == "dynamic" and max_len > cfg.max_position_embeddings:
        return (f"rope_scaling.rope_type='dynamic' is exact only below max_position_embeddings="
                f"{cfg.max_position_embeddings} (past it, transformers' frequencies depend on how "
                f"the sequence is split into steps); set max_context <= "
                f"{cfg.max_position_embeddings} (asked for {max_len})")
    return None
