"""Mixture-of-experts models through the split runtime: Qwen3-MoE (sparse and dense layers),
DeepSeek-V3 (latent attention: its KV cache holds latent rows; grouped routing, shared experts),
GLM-4.5 (grouped sigmoid routing, shared experts, a dense first layer) and gpt-oss (attention
sinks, alternating windows, its own experts). Split exactness over 1-3 shards and every CPU
transport, restore (RAM, disk, another split) and lossless speculation (DeepSeek-V3 also with a
DFlash draft fed by its layers' hidden rows).

Their parity with transformers is in tests/shards/test_model_parity.py; here the runtime's own
invariants are checked on models whose routing varies from token to token."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from layersplit.draft.dflash import write_random_dflash
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.placement import bytes_split
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint
from layersplit.shards.weights import layer_bytes

from tests.helpers import assert_speculated_equals, noisy_copy, run_logged, shard_children, trace

CHUNK = 16
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def model(request, tmp_path_factory):
    """A MoE model with weights large enough that its greedy output is not degenerate."""
    family = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("moe") / family, family, std=0.2)
    cfg = read_hf_config(path)
    dense = {"qwen3_moe": 2, "deepseek_v3": 0, "glm4_moe": 0}.get(family)  # (gpt-oss: none)
    assert [cfg.is_moe(i) for i in range(4)] == [i != dense for i in range(4)]
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
    """A classic draft: the target with noise on its weights (the tiny DeepSeek's routing flips
    at any noise in its layers, changing every token after: its draft differs in the LM head)."""
    dst = tmp_path_factory.mktemp("near") / "m"
    if read_hf_config(model).mla is None:
        return noisy_copy(model, dst)
    return noisy_copy(model, dst, 0.03, only={"lm_head.weight"})


@pytest.fixture(scope="module")
def want(ref, prompt):
    """The reference's plain runs, greedy and sampled: tokens and logits (`run_logged`)."""
    return {p.temperature: run_logged(ref, prompt, p) for p in (GREEDY, SAMPLED)}


@pytest.fixture(scope="module")
def ref_trace(ref, prompt):
    """The reference's greedy steps over the prompt (`trace`: tokens and logits per step)."""
    tokens, logits = trace(ref, prompt, 10, CHUNK)
    assert len(set(tokens)) > 3  # a model that repeats one token would prove little
    return tokens, logits


def _cfg(model, n, **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("n,transport,split", [(1, "auto", None), (2, "shm", None),
                                               (3, "zmq", "auto")])
def test_moe_split_equals_reference(model, ref_trace, near, want, prompt, n, transport, split,
                                    caplog):
    """Steps and whole runs equal the reference's bit for bit; speculated runs (a classic
    draft) too, at every accepted position's logits."""
    ref_tokens, ref_logits = ref_trace
    caplog.set_level(logging.INFO, logger="layersplit.runtime.coordinator")
    with Coordinator(_cfg(model, n, transport=(transport,), split=split,
                          draft=str(near))) as coord:
        if split == "auto":  # by weight bytes (tests/runtime/test_split_auto.py), shown
            sizes = layer_bytes(read_hf_config(model), 4)
            assert [s.end - s.start for s in coord.placement.shards] == bytes_split(sizes[0], 3,
                                                                                   *sizes[1:])
            assert "split auto (by weight bytes): 0:" in caplog.text
            if model.name == "qwen3_moe":
                assert "split auto (by weight bytes): 0:2 on cpu (0.6 MB), 2:4" in caplog.text
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
def test_moe_restore_equals_cold(model, ref, prompt, tmp_path):
    longer = prompt + ref.tokenizer.encode(" and then it ran far away")
    want = {id(p): ref.generate(p, GREEDY).tokens for p in (prompt, longer)}
    with Coordinator(_cfg(model, 2, kv_cache_dir=str(tmp_path))) as c:
        assert c.generate(prompt, GREEDY).tokens == want[id(prompt)]
        r = c.generate(longer, GREEDY)  # a RAM hit at a chunk boundary
        assert r.cache_tier == "ram" and r.cached_tokens >= CHUNK
        assert r.tokens == want[id(longer)]
    with Coordinator(_cfg(model, 3, kv_cache_dir=str(tmp_path))) as c:  # restart, other split
        for p in (prompt, longer):
            r = c.generate(p, GREEDY)
            assert r.cache_tier == "disk" and r.tokens == want[id(p)]
    assert shard_children() == []


@pytest.mark.slow
def test_mla_layers_feed_a_dflash_draft(tmp_path):
    """A DFlash draft fed by the tapped hidden rows of DeepSeek-V3's latent-attention layers,
    over 2 shards: the speculated run's tokens and logits are the reference's plain run's."""
    model = write_tiny_checkpoint(tmp_path / "deepseek_v3", "deepseek_v3", std=0.2)
    ref = ReferenceEngine(model, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    draft = write_random_dflash(read_hf_config(model), tmp_path / "dflash", taps=[1, 4])
    with Coordinator(_cfg(model, 2, draft=str(draft))) as coord:
        assert_speculated_equals(coord, prompt, GREEDY, run_logged(ref, prompt, GREEDY),
                                 "DFlash draft on MLA layers")
    assert shard_children() == []
