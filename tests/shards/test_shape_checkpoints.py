"""The family shapes the GPU parity checks use, shrunk to CPU widths: written by transformers,
read by our loader, and equal to transformers float32 through the split runtime."""

from __future__ import annotations

import pytest
from layersplit.runtime.check import CheckOptions, run_check
from layersplit.runtime.config import RuntimeConfig
from layersplit.shards.shape_checkpoints import SHAPES, write_shape_checkpoint

pytest.importorskip("transformers")  # a declared test dependency

_NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512)
SMALL = {
    "llama": _NARROW,
    "qwen3": {**_NARROW, "head_dim": 16},
    "qwen3_5": {**_NARROW, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16},
    "qwen3_moe": {**_NARROW, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                  "num_experts_per_tok": 2},
    "gemma3": {**_NARROW, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},
    "mistral": {**_NARROW, "sliding_window": 16},
    "deepseek_v3": {**_NARROW, "num_key_value_heads": 4, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 4,
                    "topk_group": 2, "num_experts_per_tok": 3},
}


def test_every_shape_has_a_cpu_size():
    assert set(SMALL) == set(SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_shape_checkpoint_matches_transformers(tmp_path, family):
    path = write_shape_checkpoint(tmp_path / family, family, "cpu", **SMALL[family])
    cfg = RuntimeConfig(model=str(path), devices=("cpu", "cpu"), max_context=512,
                        prefill_chunk=16, threads=1)
    r = run_check(cfg, CheckOptions(limit=2, new_tokens=12))
    assert r["pass"], r["failures"]
    assert r["top1_agreement"] == 1.0 and r["greedy_equal"] == 2
