"""A GGUF file run with its weights kept quantized (`weight_format = "quantized"`) through real
shard processes: the same tokens and logits as the file dequantized at load in one process
(float32 on a CPU the dequantized values are bit-identical and each projection one tile, so
the logits are too), over 2 and 3 shards, the prefix cache restored into another split; and
its prefix-cache entries apart from a dequantized run's."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_gguf

from tests.helpers import assert_same_run, run_logged

CHUNK = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_1(tiny_llama, tmp_path_factory):
    """The tiny Llama as a Q4_1 GGUF (rows of 64 and 160: whole blocks of 32)."""
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("q") / "tiny-q4_1.gguf", "Q4_1")


def _cfg(model, n, cache_dir, fmt="quantized", **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK, threads=1,
                         max_context=256, kv_cache_dir=str(cache_dir), weight_format=fmt, **kw)


@pytest.mark.slow
def test_kept_quantized_over_splits_equals_dequantized(q4_1, tmp_path):
    ref = ReferenceEngine(q4_1, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    want = run_logged(ref, prompt, GREEDY)
    assert len(set(want[0].tokens)) > 1
    with Coordinator(_cfg(q4_1, 2, tmp_path)) as c:
        assert c.weight_format == "quantized"
        assert_same_run(run_logged(c, prompt, GREEDY), want, "2 shards, kept quantized")
    with Coordinator(_cfg(q4_1, 3, tmp_path, split=(1, 3, 2))) as c:  # the 2-shard entries
        got = run_logged(c, prompt, GREEDY)
        assert got[0].cache_tier == "disk" and got[0].cached_tokens > 0
        assert_same_run(got, want, "3 shards restoring the 2-shard entries")
    with Coordinator(_cfg(q4_1, 2, tmp_path, "dequantize")) as c:  # (KV of another kind)
        got = run_logged(c, prompt, GREEDY)
        assert got[0].cached_tokens == 0
        assert_same_run(got, want, "2 shards, dequantized")
