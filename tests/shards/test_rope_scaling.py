"""Rope scaling types beyond the parity configs: dynamic NTK is served exactly below
max_position_embeddings and refused past it; unknown rope_scaling keys are refused by name.
(YaRN's parity with transformers: the `llama-yarn-rope` tiny config in test_model_parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.tiny import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("dyn") / "m", "llama", num_layers=2,
                                 max_position_embeddings=48, std=0.2)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_dynamic_rope_equals_transformers_below_its_limit(dynamic):
    ids = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(3))
    ex = RangeExecutor(load_layer_range(open_checkpoint(dynamic), 0, 2), max_len=48)
    ours = torch.cat([ex.run(ids[:30], 0, all_logits=True)]
                     + [ex.run(ids[p:p + 1], p, all_logits=True) for p in range(30, 48)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(dynamic, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        # past the limit transformers' own answer depends on how the sequence is split
        longer = torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(4))
        whole = hf(longer[None]).logits[0, -1]
        out = hf(longer[None, :40], use_cache=True)  # keys 0..39 at the default frequencies
        stepped = hf(longer[None, 40:], past_key_values=out.past_key_values).logits[0, -1]
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)  # logits of size ~3 here
    assert (whole - stepped).abs().max().item() > 1e-4


def test_dynamic_rope_past_its_limit_is_refused(dynamic):
    model = load_layer_range(open_checkpoint(dynamic), 0, 2)
    with pytest.raises(CheckpointError, match=r"rope_type='dynamic'.*max_context <= 48"):
        RangeExecutor(model, max_len=49)


def test_coordinator_refuses_a_dynamic_context_past_its_limit(dynamic):
    from layersplit.runtime.config import ConfigError, RuntimeConfig
    from layersplit.runtime.coordinator import Coordinator

    with pytest.raises(ConfigError, match="max_context <= 48"):
        Coordinator(RuntimeConfig(model=str(dynamic), devices=("cpu",), max_context=64))
