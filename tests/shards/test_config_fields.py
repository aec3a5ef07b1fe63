"""Every config field a family's code does not implement is refused by name (never silently
ignored), and the window fields each family does implement are read as transformers reads them."""

from __future__ import annotations

import pytest

from shards.errors import CheckpointError
from shards.model_config import config_from_hf
from shards.tiny import FAMILY_CONFIGS

BASE = {"num_hidden_layers": 4, "vocab_size": 320}

# (family, field, value, what the error must name)
REFUSED = [
    ("llama", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("llama", "final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("llama", "sliding_window", 8, "sliding_window"),  # Llama has no window in transformers
    ("llama", "mlp_bias", True, "mlp_bias"),
    ("llama", "hidden_act", "gelu", "hidden_act"),
    ("llama", "pretraining_tp", 2, "pretraining_tp"),
    ("llama", "quantization_config", {"quant_method": "awq"}, "quantization_config"),
    ("llama", "partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("llama", "rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
    ("mistral-window", "layer_types", ["full_attention", "chunked_attention"] * 2,
     "chunked_attention"),
    ("mistral-window", "sliding_window", 0, "sliding_window"),
    ("qwen2", "num_experts", 8, "num_experts"),
    ("qwen2", "layer_types", ["linear_attention"] * 4, "linear_attention"),
    ("qwen3", "use_qk_norm_scaling", True, "use_qk_norm_scaling"),
    ("qwen3", "layer_types", ["sliding_attention"] * 4, "sliding_window"),  # no window set
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
