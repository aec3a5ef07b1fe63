"""An FP8 checkpoint (`quant_method = "fp8"`) through real shard processes, dequantized at load
and kept in FP8 (`weight_format = "quantized"`): the tokens and logits of the same model stored
dequantized, run in one process, over 1 and 2 shards and over 3 restoring the 2-shard
prefix-cache entries from disk (float32 on a CPU: the values are bit-identical and each
projection one tile, so the logits are too)."""

from __future__ import annotations

import shutil

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_logged, write_fp8

CHUNK = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_fp8_over_splits_equals_its_dequantized_weights(tiny_llama, tmp_path):
    dense = tmp_path / "dense"
    shutil.copytree(tiny_llama, dense)
    fp8 = write_fp8(dense, tmp_path / "fp8")
    ref = ReferenceEngine(dense, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    want = run_logged(ref, prompt, GREEDY)
    assert len(set(want[0].tokens)) > 1

    def cfg(n: int, **kw) -> RuntimeConfig:
        return RuntimeConfig(model=str(fp8), devices=("cpu",) * n, prefill_chunk=CHUNK,
                             threads=1, max_context=256, kv_cache_dir=str(tmp_path / "kv"), **kw)

    with Coordinator(cfg(1, prefix_cache=False)) as c:
        assert_same_run(run_logged(c, prompt, GREEDY), want, "FP8, 1 shard")
    with Coordinator(cfg(2)) as c:
        assert_same_run(run_logged(c, prompt, GREEDY), want, "FP8, 2 shards")
    with Coordinator(cfg(3, split=(1, 3, 2))) as c:
        got = run_logged(c, prompt, GREEDY)
        assert got[0].cache_tier == "disk" and got[0].cached_tokens > 0
        assert_same_run(got, want, "FP8, 3 shards restoring the 2-shard entries")
    with Coordinator(cfg(2, weight_format="quantized", prefix_cache=False)) as c:
        assert c.weight_format == "quantized"  # (the projections kept in FP8)
        assert_same_run(run_logged(c, prompt, GREEDY), want, "FP8 kept, 2 shards")
