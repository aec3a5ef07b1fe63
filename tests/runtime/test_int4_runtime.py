"""GPTQ (act order) and AWQ int4 checkpoints through real shard processes, kept in int4
(`weight_format = "quantized"`, `layers.int4_linear`): the tokens and logits of the same model
stored dequantized, run in one process, over 1 and 2 shards (float32 on a CPU: the values are
bit-identical and each projection one tile, so the logits are too)."""

from __future__ import annotations

import shutil

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_logged, write_int4

CHUNK = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_kept_over_splits_equals_its_dequantized_weights(tiny_llama, tmp_path, method):
    dense = tmp_path / "dense"
    shutil.copytree(tiny_llama, dense)
    packed = write_int4(dense, tmp_path / method, method, act_order=method == "gptq")
    ref = ReferenceEngine(dense, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    want = run_logged(ref, prompt, GREEDY)
    assert len(set(want[0].tokens)) > 1

    def cfg(n: int) -> RuntimeConfig:
        return RuntimeConfig(model=str(packed), devices=("cpu",) * n, prefill_chunk=CHUNK,
                             threads=1, max_context=256, weight_format="quantized",
                             prefix_cache=False)

    for n in (1, 2):
        with Coordinator(cfg(n)) as c:
            assert c.weight_format == "quantized"  # (the projections kept in int4)
            assert_same_run(run_logged(c, prompt, GREEDY), want, f"{method} kept, {n} shards")
