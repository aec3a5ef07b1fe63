"""Mixture-of-experts models through the split runtime: Qwen3-MoE (sparse and dense layers) and
DeepSeek-V3 (latent attention: its KV cache holds latent rows; grouped routing, shared experts).
Split exactness over 1-3 shards and every CPU transport, restore (RAM, disk, another split) and
lossless speculation (DeepSeek-V3 also with a DFlash draft fed by its layers' hidden rows).

Their parity with transformers is in tests/shards/test_model_parity.py; here the runtime's own
invariants are checked on models whose routing varies from token to token."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from layersplit.draft.dflash import write_random_dflash
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.placement import bytes_split
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint
from layersplit.shards.weights import layer_bytes
from safetensors.torch import load_file, save_file

from tests.helpers import shard_children, trace

CHUNK = 16
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory):
    """A MoE model with weights large enough that its greedy output is not degenerate."""
    family = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("moe") / family, family, std=0.2)
    cfg = read_hf_config(path)
    assert cfg.is_moe(3) and not cfg.is_moe(2 if family == "qwen3_moe" else 0)
    return path


@pytest.fixture(scope="module")
def ref(model):
    return ReferenceEngine(model, prefill_chunk=CHUNK, max_context=256)


@pytest.fixture(scope="module")
def prompt(ref):
    ids = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    assert len(ids) > 2 * CHUNK
    return ids


def _cfg(model, n, **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("n,transport,split", [(1, "auto", None), (2, "shm", None),
                                               (3, "zmq", "auto")])
def test_moe_split_equals_reference(model, ref, prompt, n, transport, split, caplog):
    ref_tokens, ref_logits = trace(ref, prompt, 10, CHUNK)
    assert len(set(ref_tokens)) > 3  # a model that repeats one token would prove little
    caplog.set_level(logging.INFO, logger="layersplit.runtime.coordinator")
    with Coordinator(_cfg(model, n, transport=(transport,), split=split)) as coord:
        if split == "auto":  # by weight bytes (tests/runtime/test_split_auto.py), shown
            sizes = layer_bytes(read_hf_config(model), 4)
            assert [s.end - s.start for s in coord.placement.shards] == bytes_split(sizes[0], 3,
                                                                                   *sizes[1:])
            assert "split auto (by weight bytes): 0:" in caplog.text
        tokens, logits = trace(coord, prompt, 10, CHUNK)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)
        assert coord.generate(prompt, SAMPLED).tokens == ref.generate(prompt, SAMPLED).tokens
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
def test_moe_speculation_equals_plain(model, prompt, tmp_path):
    near = tmp_path / "near"  # a classic draft: the target with noise on its weights
    shutil.copytree(model, near)
    cfg = read_hf_config(model)
    g = torch.Generator().manual_seed(1)
    # (the tiny DeepSeek's routing flips at any noise in its layers, changing every token
    # after: its near draft differs in the LM head only)
    noise = {k: 0.01 if cfg.mla is None else 0.03 * (k == "lm_head.weight")
             for k in load_file(str(model / "model.safetensors"))}
    state = {k: v + noise[k] * torch.randn(v.shape, generator=g)
             for k, v in load_file(str(model / "model.safetensors")).items()}
    save_file(state, str(near / "model.safetensors"))
    drafts = [near]
    if cfg.mla is not None:  # a draft fed by the target's hidden rows (taps of MLA layers)
        drafts.append(write_random_dflash(cfg, tmp_path / "dflash", taps=[1, 4]))
    for draft in drafts:
        with Coordinator(_cfg(model, 2, draft=str(draft))) as coord:
            for params in (GREEDY, SAMPLED) if draft is near else (GREEDY,):
                plain = coord.generate(prompt, params, use_cache=False, speculative=False)
                spec = coord.generate(prompt, params, use_cache=False)
                assert spec.tokens == plain.tokens, draft.name
                assert spec.acceptance_length is not None, draft.name
                if draft is near:  # kept and rejected drafts: both paths of a verify step ran
                    assert 1.0 < spec.acceptance_length < 5.0
    assert shard_children() == []
