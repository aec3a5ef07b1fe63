"""Sliding-window models (Mistral's `sliding_window`, Qwen2's windowed upper layers) through the
split runtime: split exactness, restore and speculation, with prompts several windows long;
Gemma 3 (windowed layers with a local rope among global ones, a soft-capped head): speculation
equals the reference's plain run, logits included, on 1, 2 and 3 shards.

Their parity with transformers is in tests/shards/test_model_parity.py; here the runtime's own
invariants are checked on a model whose output a missing window would change."""

from __future__ import annotations

import numpy as np
import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint

from tests.helpers import assert_speculated_equals, noisy_copy, run_logged, shard_children, trace

CHUNK = 16
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A windowed Mistral with weights large enough that its greedy output is not degenerate."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("window") / "mistral-window",
                                 "mistral-window", std=0.2)
    assert read_hf_config(path).sliding_window == 12  # shorter than every prompt below
    return path


@pytest.fixture(scope="module")
def ref(model):
    return ReferenceEngine(model, prefill_chunk=CHUNK, max_context=256)


@pytest.fixture(scope="module")
def prompt(ref):
    ids = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    assert len(ids) > 2 * CHUNK
    return ids


@pytest.fixture(scope="module")
def near(model, tmp_path_factory):
    """A classic draft: the target with noise on its weights."""
    return noisy_copy(model, tmp_path_factory.mktemp("near") / "m")


@pytest.fixture(scope="module")
def want(ref, prompt):
    """The reference's plain runs, greedy and sampled: tokens and logits (`run_logged`)."""
    return {p.temperature: run_logged(ref, prompt, p) for p in (GREEDY, SAMPLED)}


def _cfg(model, n, **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("n,transport", [(1, "auto"), (2, "shm"), (3, "zmq")])
def test_windowed_split_equals_reference(model, ref, near, want, prompt, n, transport):
    """Steps and whole runs equal the reference's bit for bit; speculated runs (a classic
    draft) too, at every accepted position's logits."""
    ref_tokens, ref_logits = trace(ref, prompt, 10, CHUNK)
    assert len(set(ref_tokens)) > 3  # a model that repeats one token would prove little
    with Coordinator(_cfg(model, n, transport=(transport,), draft=str(near))) as coord:
        tokens, logits = trace(coord, prompt, 10, CHUNK)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)
        for params in (GREEDY, SAMPLED):
            spec = assert_speculated_equals(coord, prompt, params, want[params.temperature],
                                            f"temperature {params.temperature}")
            # draft tokens were kept and others rejected: both paths of a verify step ran
            assert 1.0 < spec.acceptance_length < 5.0
    assert shard_children() == []


@pytest.mark.slow
def test_windowed_restore_equals_cold(model, ref, prompt, tmp_path):
    longer = prompt + ref.tokenizer.encode(" and then it ran far away")
    want = {id(p): ref.generate(p, GREEDY).tokens for p in (prompt, longer)}
    with Coordinator(_cfg(model, 2, kv_cache_dir=str(tmp_path))) as c:
        assert c.generate(prompt, GREEDY).tokens == want[id(prompt)]
        r = c.generate(longer, GREEDY)  # a RAM hit at a chunk boundary past the window
        assert r.cache_tier == "ram" and r.cached_tokens > 12
        assert r.tokens == want[id(longer)]
    with Coordinator(_cfg(model, 3, kv_cache_dir=str(tmp_path))) as c:  # restart, other split
        for p in (prompt, longer):
            r = c.generate(p, GREEDY)
            assert r.cache_tier == "disk" and r.tokens == want[id(p)]
    assert shard_children() == []


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3 (layers 2 and 5 global, the others windowed at 12 positions), its reference,
    a prompt several windows long, the reference's plain runs (greedy and sampled) and a classic
    draft (the target with noise on its weights)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("gemma") / "gemma3", "gemma3_text",
                                 std=0.2)
    ref = ReferenceEngine(path, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    want = {p.temperature: run_logged(ref, prompt, p) for p in (GREEDY, SAMPLED)}
    assert len(set(want[0.0][0].tokens)) > 3  # a model that repeats one token would prove little
    return path, prompt, want, noisy_copy(path, tmp_path_factory.mktemp("gemma-near") / "m")


@pytest.mark.slow
@pytest.mark.parametrize("n,transport", [(1, "auto"), (2, "shm"), (3, "zmq")])
def test_gemma3_speculation_equals_reference(gemma, n, transport):
    """Speculated runs (a classic draft), greedy and sampled, give the reference's plain tokens
    and, at every accepted position, its float32 logits bit for bit."""
    path, prompt, want, near = gemma
    with Coordinator(_cfg(path, n, transport=(transport,), draft=str(near))) as coord:
        for params in (GREEDY, SAMPLED):
            spec = assert_speculated_equals(coord, prompt, params, want[params.temperature],
                                            f"temperature {params.temperature}")
            assert 1.0 < spec.acceptance_length < 5.0  # kept and rejected draft tokens
    assert shard_children() == []
