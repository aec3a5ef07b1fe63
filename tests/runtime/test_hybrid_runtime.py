"""Hybrid models (Qwen3.5 text, Qwen3.5-MoE text, Qwen3-Next) under the split: the CLI gives
transformers' greedy tokens; 1, 2 and 3 shards equal the reference bit for bit (splits inside a
run of linear layers and next to an attention layer); the prefix cache restores conv and
recurrent state exactly (RAM, disk after a restart, into another split; a flipped byte in a
state tensor is a miss); speculation equals the reference's plain decoding, logits included."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from layersplit.ipc.kv_file import read_layout
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.chunking import cut_points
from layersplit.shards.sampling import SamplingParams

from tests.helpers import (
    assert_speculated_equals,
    layersplit_shm,
    noisy_copy,
    run_cli,
    run_logged,
    shard_children,
    trace,
)

transformers = pytest.importorskip("transformers")
CHUNK = 16
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
CHAT = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n<|im_start|>assistant\n"


def _cfg(model, n, **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, **kw)


@pytest.fixture(scope="module")
def refs(hybrid_models):
    return {fam: ReferenceEngine(p, prefill_chunk=CHUNK, max_context=256)
            for fam, p in hybrid_models.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_cli_generate_on_three_shards_gives_transformers_greedy_tokens(hybrid_models, refs,
                                                                       family):
    model = hybrid_models[family]
    text = "the quick brown fox jumps over the lazy dog"
    out = run_cli("generate", text, "--model", str(model), "--devices", "cpu,cpu,cpu",
                  "--max-tokens", "12", "--ignore-eos", "--json", "--prefix-cache", "off")
    assert out.returncode == 0, out.stderr[-2000:]
    tokens = json.loads(out.stdout)["tokens"]
    ids = refs[family].tokenizer.encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(want)) > 3  # not a degenerate model
    assert tokens == want


# (3 shards over zmq: Qwen3.5-MoE's, in test_moe_hybrid_split_and_restore)
CASES = [("qwen3_5", 1, "auto", None), ("qwen3_5", 2, "shm", (1, 5)),
         ("qwen3_next", 3, "shm", (1, 3, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("family,n,transport,split", CASES,
                         ids=[f"{c[0]}-{c[1]}shard-{c[2]}" for c in CASES])
def test_split_equals_reference(hybrid_models, refs, tmp_path_factory, family, n, transport,
                                split):
    """Steps and whole runs equal the reference's bit for bit; speculated runs (a classic
    draft: the target with noise on its weights) too, at every accepted position's logits."""
    before = layersplit_shm()
    ref = refs[family]
    prompt = ref.tokenizer.encode(CHAT * 3)
    assert len(prompt) > 3 * CHUNK
    ref_tokens, ref_logits = trace(ref, prompt, 8, CHUNK)
    near = noisy_copy(hybrid_models[family], tmp_path_factory.mktemp("near") / "m", 0.02)
    with Coordinator(_cfg(hybrid_models[family], n, transport=(transport,), split=split,
                          draft=str(near), spec_block=4)) as coord:
        tokens, logits = trace(coord, prompt, 8, CHUNK)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)  # bit for bit
        kept = []
        for params in (GREEDY, SAMPLED):
            spec = assert_speculated_equals(coord, prompt, params, run_logged(ref, prompt, params),
                                            f"temperature {params.temperature}")
            kept.append(spec.acceptance_length)
        assert any(1.0 < a < 4.0 for a in kept), kept  # partial accepts happened
        # no host tier: a preempted sequence's recurrent state is not in its blocks
        assert coord.batcher.host is None
        assert [s["kv_host_blocks"] for s in coord.shard_info()] == [0] * n
    assert shard_children() == []
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_moe_hybrid_split_and_restore(hybrid_models, refs, tmp_path):
    """Qwen3.5-MoE (routed experts in every layer): the reference gives transformers' greedy
    tokens; 3 shards over zmq equal it bit for bit, speculated runs (a classic draft) too, at
    every accepted position's logits; the entry they write restores after a restart into 2
    shards as the cold output."""
    model, ref = hybrid_models["qwen3_5_moe"], refs["qwen3_5_moe"]
    prompt = ref.tokenizer.encode(CHAT * 3)
    ref_tokens, ref_logits = trace(ref, prompt, 8, CHUNK)
    assert len(set(ref_tokens)) > 3  # a model that repeats one token would prove little
    cold = ref.generate(prompt, GREEDY).tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' greedy tokens
        assert cold == hf.generate(torch.tensor([prompt]), max_new_tokens=len(cold),
                                   do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    want = {p.temperature: run_logged(ref, prompt, p) for p in (GREEDY, SAMPLED)}
    # (the routing flips at any noise in its layers: the draft differs in its LM head)
    near = noisy_copy(model, tmp_path / "near", 0.03, only={"lm_head.weight"})
    with Coordinator(_cfg(model, 3, transport=("zmq",), split=(2, 2, 2),
                          kv_cache_dir=str(tmp_path / "kv"), draft=str(near),
                          spec_block=4)) as coord:
        tokens, logits = trace(coord, prompt, 8, CHUNK)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)  # bit for bit
        kept = [assert_speculated_equals(coord, prompt, p, want[p.temperature],
                                         f"temperature {p.temperature}").acceptance_length
                for p in (GREEDY, SAMPLED)]
        assert any(1.0 < a < 4.0 for a in kept), kept  # partial accepts happened
        assert coord.generate(prompt, GREEDY, speculative=False).tokens == cold
    with Coordinator(_cfg(model, 2, split=(1, 5), kv_cache_dir=str(tmp_path / "kv"))) as coord:
        r = coord.generate(prompt, GREEDY)
        assert (r.cache_tier, r.cached_tokens) == ("disk", len(prompt))
        assert r.tokens == cold
    assert shard_children() == []


def _state_tensor(path) -> tuple[int, int]:
    """(offset, bytes) of the first recurrent-state tensor of an entry file."""
    layout = read_layout(path)
    name = next(n for n in sorted(layout.tensors) if n.endswith(".state"))
    return layout.offset(name), layout.tensors[name].nbytes


@pytest.mark.slow
def test_prefix_cache_restores_state_exactly(hybrid_models, refs, tmp_path):
    """RAM hit, disk hit after a restart: each equals a cold run; the chat's second turn
    restores the first turn's entry and prefills the rest; a damaged entry is a miss in 3
    shards."""
    model, ref = hybrid_models["qwen3_5"], refs["qwen3_5"]
    first = ref.tokenizer.encode(CHAT * 2)
    second = first + ref.tokenizer.encode("<|im_start|>user\nand the dog<|im_end|>\n")
    cold = {id(p): ref.generate(p, GREEDY).tokens for p in (first, second)}
    with Coordinator(_cfg(model, 2, kv_cache_dir=str(tmp_path), split=(1, 5))) as c:
        r = c.generate(first, GREEDY)
        assert r.cache_tier == "none" and r.tokens == cold[id(first)]
        r = c.generate(second, GREEDY)  # restores the first turn, prefills the new one
        last_turn = max(cut_points(first, CHUNK, (2,)))  # (the first prompt's last cut)
        assert 0 < last_turn < len(first) and last_turn % CHUNK
        assert (r.cache_tier, r.cached_tokens) == ("ram", last_turn)
        assert r.tokens == cold[id(second)]
        r = c.generate(first, GREEDY)  # an exact repeat: no forward pass before decoding
        assert r.cache_tier == "ram" and r.tokens == cold[id(first)]
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files and all(any(n.endswith(".conv") for n in read_layout(f).tensors)
                         for f in files)
    # a restart (a restart into another split: test_moe_hybrid_split_and_restore)
    with Coordinator(_cfg(model, 2, kv_cache_dir=str(tmp_path), split=(1, 5))) as c:
        r = c.generate(second, GREEDY)
        assert r.cache_tier == "disk" and r.cached_tokens == len(second)
        assert r.tokens == cold[id(second)]
    # a flipped byte in a recurrent state: a miss (the file set aside), never a wrong token
    for f in sorted(tmp_path.glob("*.safetensors")):
        off, _ = _state_tensor(f)
        data = bytearray(f.read_bytes())
        data[off + 5] ^= 0xFF
        f.write_bytes(bytes(data))
    with Coordinator(_cfg(model, 3, kv_cache_dir=str(tmp_path))) as c:
        r = c.generate(second, GREEDY)
        assert (r.cache_tier, r.cached_tokens) == ("none", 0)
        assert r.tokens == cold[id(second)]
        assert c.cache.stats.bad_files >= 1
