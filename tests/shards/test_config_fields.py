"""Every config field a family's code does not implement is refused by name (never silently
ignored), and the window fields each family does implement are read as transformers reads them."""

from __future__ import annotations

import pytest
from layersplit.shards.errors import CheckpointError
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.tiny import FAMILY_CONFIGS

BASE = {"num_hidden_layers": 4, "vocab_size": 320}

# (family, field, value, what the error must name)
REFUSED = [
    ("llama", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("llama", "final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("llama", "sliding_window", 8, "sliding_window"),  # Llama has no window in transformers
    ("llama", "mlp_bias", True, "mlp_bias"),
    ("llama", "hidden_act", "gelu", "hidden_act"),
    ("llama", "pretraining_tp", 2, "pretraining_tp"),
    ("llama", "quantization_config", {"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ("llama", "quantization_config", {"quant_method": "awq", "version": "gemm", "group_size": 128},
     "bits"),  # (int4 only, and said so)
    ("llama", "partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("llama", "rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 2.0, "short_factor": [1.0]},
     "short_factor"),
    ("llama", "rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("llama", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0, "alpha": 1.0}, "alpha"),
    ("mistral-window", "layer_types", ["full_attention", "chunked_attention"] * 2,
     "chunked_attention"),
    ("mistral-window", "sliding_window", 0, "sliding_window"),
    ("qwen2", "num_experts", 8, "num_experts"),
    ("qwen2", "layer_types", ["linear_attention"] * 4, "linear_attention"),
    ("qwen3", "use_qk_norm_scaling", True, "use_qk_norm_scaling"),
    ("qwen3", "layer_types", ["sliding_attention"] * 4, "sliding_window"),  # no window set
    # mixture-of-experts routing variants the MoE families do not implement
    ("qwen3_moe", "routed_scaling_factor", 2.5, "routed_scaling_factor"),
    ("qwen3_moe", "scoring_func", "sigmoid", "scoring_func"),
    ("qwen3_moe", "shared_expert_intermediate_size", 64, "shared_expert_intermediate_size"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok"),
    ("qwen3_moe", "mlp_only_layers", "1,2", "mlp_only_layers"),
    ("qwen3_moe", "decoder_sparse_step", 0, "decoder_sparse_step"),
    ("qwen3_moe", "layer_types", ["full_attention"] * 4, "layer_types"),
    ("mixtral", "n_shared_experts", 1, "n_shared_experts"),
    ("mixtral", "num_local_experts", -1, "num_local_experts"),
    ("qwen2_moe", "topk_group", 2, "topk_group"),
    ("gemma3_text", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("gemma3_text", "use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("gemma3_text", "hidden_activation", "gelu", "hidden_activation"),
    ("gemma3_text", "final_logit_softcapping", -1.0, "final_logit_softcapping"),
    ("gemma3_text", "rope_parameters", {"sliding_attention": {"rope_type": "linear",
                                                              "factor": 2.0}},
     "sliding_attention"),
    ("gemma3_text", "layer_types", ["chunked_attention"] * 4, "chunked_attention"),
    ("gemma3_text", "max_window_layers", 2, "max_window_layers"),
    # GLM-4.5: routing and rotary values transformers' code does not implement; MLA fields
    ("glm4_moe", "topk_method", "greedy", "topk_method"),
    ("glm4_moe", "scoring_func", "softmax", "scoring_func"),
    ("glm4_moe", "moe_router_dtype", "bfloat16", "moe_router_dtype"),
    ("glm4_moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("glm4_moe", "n_group", 3, "n_group"),  # 8 experts do not split into 3 groups
    ("glm4_moe", "topk_group", 5, "topk_group"),
    ("glm4_moe", "num_experts_per_tok", 5, "num_experts_per_tok"),  # > 2 groups of 2
    ("glm4_moe", "partial_rotary_factor", 0.0, "partial_rotary_factor"),
    ("glm4_moe", "q_lora_rank", 64, "q_lora_rank"),
    ("glm4_moe", "sliding_window", 8, "sliding_window"),
    ("glm4_moe", "rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
    # gpt-oss: other quantizations, windows, activations
    ("gpt_oss", "quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("gpt_oss", "quantization_config", {"quant_method": "mxfp4", "group_size": 16},
     "quantization_config"),
    ("gpt_oss", "experts_per_token", 3, "experts_per_token"),
    ("gpt_oss", "swiglu_limit", 0, "swiglu_limit"),
    ("gpt_oss", "layer_types", ["chunked_attention"] * 4, "chunked_attention"),
    ("gpt_oss", "sliding_window", 0, "sliding_window"),
    ("gpt_oss", "attn_logit_softcapping", 30.0, "attn_logit_softcapping"),
    ("gpt_oss", "partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("gpt_oss", "hidden_act", "gelu", "hidden_act"),
    # transformers biases o_proj too there
    ("llama", "attention_bias", True, "attention_bias=true also biases o_proj"),
    ("qwen3_moe", "attention_bias", True, "o_proj"),
    ("gemma3_text", "attention_bias", True, "o_proj"),
]


@pytest.mark.parametrize("family,field,value,named", REFUSED,
                         ids=[f"{f}-{k}" for f, k, _, _ in REFUSED])
def test_unsupported_field_is_refused_by_name(family, field, value, named):
    raw = {**FAMILY_CONFIGS[family], **BASE, field: value}
    with pytest.raises(CheckpointError, match=named) as e:
        config_from_hf(raw, "config.json")
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_tiny_family_config_is_accepted(family):
    config_from_hf({**FAMILY_CONFIGS[family], **BASE}, "config.json")


def test_windows_as_transformers_reads_them():
    mistral = config_from_hf({**FAMILY_CONFIGS["mistral-window"], **BASE}, "c")
    assert [mistral.window(i) for i in range(4)] == [12] * 4
    qwen2 = config_from_hf({**FAMILY_CONFIGS["qwen2-window"], **BASE}, "c")
    assert [qwen2.window(i) for i in range(4)] == [None, None, None, 10]
    # Qwen2 checkpoints ship a sliding_window with use_sliding_window false: no window at all,
    # and the same config (and prefix-cache fingerprint) as without the fields
    off = {**FAMILY_CONFIGS["qwen2"], **BASE, "sliding_window": 32768, "max_window_layers": 2,
           "layer_types": ["full_attention"] * 4}
    plain = config_from_hf({**FAMILY_CONFIGS["qwen2"], **BASE}, "c")
    assert config_from_hf(off, "c").to_dict() == plain.to_dict()
    assert "layer_types" not in plain.to_dict()
    # Mistral v0.2+ sets sliding_window null: full attention
    full = config_from_hf({**FAMILY_CONFIGS["mistral-window"], **BASE, "sliding_window": None},
                          "c")
    assert full.window(0) is None
    # an explicit layer_types wins over max_window_layers
    explicit = {**FAMILY_CONFIGS["qwen2-window"], **BASE,
                "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert [config_from_hf(explicit, "c").window(i) for i in range(4)] == [10, None, 10, None]
    # the config travels between processes as a dict
    assert type(qwen2).from_dict(qwen2.to_dict()) == qwen2


def test_moe_fields_as_transformers_reads_them():
    q3 = config_from_hf({**FAMILY_CONFIGS["qwen3_moe"], **BASE}, "c")
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size) == (8, 2, 32)
    assert q3.norm_topk_prob and [q3.is_moe(i) for i in range(4)] == [True, True, False, True]
    # transformers 5's save_pretrained writes Qwen3-MoE's num_experts as num_local_experts
    raw = {**FAMILY_CONFIGS["qwen3_moe"], **BASE, "num_local_experts": 8}
    del raw["num_experts"]
    assert config_from_hf(raw, "c") == q3
    q2 = config_from_hf({**FAMILY_CONFIGS["qwen2_moe"], **BASE}, "c")
    assert [q2.is_moe(i) for i in range(4)] == [False, True, False, True]  # sparse step 2
    assert q2.shared_expert_intermediate_size == 48 and not q2.norm_topk_prob
    assert q2.attention_bias  # Qwen2-MoE's q/k/v bias is `qkv_bias`
    mx = config_from_hf({**FAMILY_CONFIGS["mixtral"], **BASE}, "c")
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 48 and mx.window(3) == 24
    no_experts = config_from_hf({**FAMILY_CONFIGS["qwen3_moe"], **BASE, "num_experts": 0}, "c")
    assert not any(no_experts.is_moe(i) for i in range(4))  # transformers: all dense
    # Qwen2-MoE windows the even layers below max_window_layers
    win = config_from_hf({**FAMILY_CONFIGS["qwen2_moe"], **BASE, "use_sliding_window": True,
                          "sliding_window": 8, "max_window_layers": 3}, "c")
    assert [win.window(i) for i in range(4)] == [8, None, 8, None]
    for cfg in (q3, q2, mx):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
    # a dense config's dict (its prefix-cache fingerprint) has no MoE keys
    dense = config_from_hf({**FAMILY_CONFIGS["qwen3"], **BASE}, "c").to_dict()
    assert not {"num_experts", "dense_layers", "norm_topk_prob"} & dense.keys()


def test_gemma3_fields_as_transformers_reads_them():
    g = config_from_hf({**FAMILY_CONFIGS["gemma3_text"], **BASE, "num_hidden_layers": 6}, "c")
    assert [g.window(i) for i in range(6)] == [12, 12, None, 12, 12, None]  # pattern 3
    assert g.local_rope_theta == 10000.0 and g.rope_theta == 1e6 and g.rope_type == "linear"
    assert g.attn_scale == 24 ** -0.5 and g.final_logit_softcap == 3.0
    assert g.tie_word_embeddings and g.hidden_act == "gelu_pytorch_tanh"
    # transformers 5 writes the ropes nested by layer kind: the same model
    nested = {k: v for k, v in FAMILY_CONFIGS["gemma3_text"].items()
              if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    nested["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert config_from_hf({**nested, **BASE, "num_hidden_layers": 6}, "c") == g
    # defaults: window 4096, every 6th layer global, head_dim 256, scalar 256
    bare = {k: v for k, v in FAMILY_CONFIGS["gemma3_text"].items()
            if k not in ("sliding_window", "sliding_window_pattern", "head_dim",
                         "query_pre_attn_scalar")}
    d = config_from_hf({**bare, **BASE, "num_hidden_layers": 7}, "c")
    assert [d.window(i) for i in range(7)] == [4096] * 5 + [None, 4096]
    assert d.head_dim == 256 and d.attn_scale == 256 ** -0.5
    assert type(g).from_dict(g.to_dict()) == g


def test_attention_bias_where_transformers_ignores_it():
    """Mistral's, Mixtral's and Qwen2's q/k/v biases are fixed in transformers: the field is
    inert there, as here."""
    for family, fixed in (("mistral-window", False), ("mixtral", False), ("qwen2", True)):
        for value in (True, False):
            raw = {**FAMILY_CONFIGS[family], **BASE, "attention_bias": value}
            assert config_from_hf(raw, "c").attention_bias is fixed


def test_inert_fields_of_published_configs_are_accepted():
    """Fields real Llama-family configs carry that change nothing (SmolLM2's config.json has
    the first three) load; rope_interleaved is accepted only when off."""
    raw = {**FAMILY_CONFIGS["llama"], **BASE, "is_llama_config": True, "rope_interleaved": False,
           "transformers.js_config": {"dtype": "q4"}, "max_sequence_length": 2048}
    config_from_hf(raw, "c")
    with pytest.raises(CheckpointError, match="rope_interleaved"):
        config_from_hf({**raw, "rope_interleaved": True}, "c")


def test_mistral_windows_every_layer_whatever_layer_types_says():
    """transformers' Mistral ignores layer_types (with a warning) and windows every layer."""
    raw = {**FAMILY_CONFIGS["mistral-window"], **BASE,
           "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert [config_from_hf(raw, "c").window(i) for i in range(4)] == [12] * 4


def test_glm4_moe_and_gpt_oss_fields_as_transformers_reads_them():
    """GLM-4.5: the rotary's width from a top-level or a nested partial_rotary_factor (0.5 when
    absent), the first k layers dense. gpt-oss: even layers windowed when layer_types is absent,
    YaRN when no rope is given, an MXFP4 quantization_config accepted."""
    glm = {**FAMILY_CONFIGS["glm4_moe"], **BASE}
    cfg = config_from_hf(glm, "c")
    assert (cfg.rotary_dim, cfg.rope_type, cfg.dense_layers) == (16, "default", (0,))
    assert cfg.group_routing.n_group == 4 and cfg.qk_norm and cfg.attention_bias
    del glm["partial_rotary_factor"]
    assert config_from_hf(glm, "c").rotary_dim == 16
    del glm["rope_theta"]  # (transformers 5 writes it into rope_parameters)
    glm["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                              "partial_rotary_factor": 0.25}
    cfg = config_from_hf({**glm, "first_k_dense_replace": 3}, "c")
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.dense_layers) == (8, 1e6, (0, 1, 2))
    oss = {**FAMILY_CONFIGS["gpt_oss"], **BASE}
    del oss["rope_scaling"], oss["rope_theta"]
    cfg = config_from_hf({**oss, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}, "c")
    assert [cfg.window(i) for i in range(4)] == [12, None, 12, None]
    assert cfg.rope_type == "yarn" and cfg.rope_theta == 150000.0
    assert cfg.rope_params["factor"] == 32.0 and cfg.rope_params["truncate"] is False
    assert cfg.num_experts == 4 and cfg.moe_intermediate_size == 32
    assert cfg.gpt_oss.swiglu_alpha == 1.702 and cfg.gpt_oss.swiglu_limit == 1.0
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
