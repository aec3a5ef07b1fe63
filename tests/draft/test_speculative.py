"""Invariant 2: speculative output equals plain output, with 1, 2 and 3 shards, over every CPU
transport, for a DFlash draft and a classic draft, greedy and sampled. Also: feature rows come
from the right shards for the right positions, a restored prefix keeps speculating, and a draft
that dies or sends garbage costs speculation, never tokens."""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draft.dflash import write_random_dflash
from ipc.messages import message
from runtime.chunking import prefill_chunks
from runtime.config import RuntimeConfig
from runtime.coordinator import Coordinator, ShardFailure
from runtime.errors import DraftError
from runtime.generate import Progress
from runtime.reference import ReferenceEngine
from shards.checkpoint import load_layer_range, open_checkpoint
from shards.executor import RangeExecutor
from shards.model_config import read_hf_config
from shards.sampling import SamplingParams
from shards.tiny import write_tiny_checkpoint
from tests.helpers import layersplit_shm, shard_children, wait_gone

CHUNK = 16
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)
TEXT = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n<|im_start|>assistant\nthe cat"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama whose greedy output is not degenerate (larger weights)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama", std=0.2)


@pytest.fixture(scope="module")
def dflash(target, tmp_path_factory):
    """A random DFlash draft tapping a layer of each of 2 shards (0:3, 3:6)."""
    return write_random_dflash(read_hf_config(target), tmp_path_factory.mktemp("dflash"),
                               layers=1, taps=[1, 4], block_size=4)


@pytest.fixture(scope="module")
def near(target, tmp_path_factory):
    """A classic draft: the target with noise on its weights (it agrees often, not always)."""
    out = tmp_path_factory.mktemp("near") / "m"
    shutil.copytree(target, out)
    state = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def _cfg(target, n, draft, **kw):
    return RuntimeConfig(model=str(target), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, draft=str(draft), **kw)


def _prompts(tok):
    return [tok.encode(TEXT * 2), tok.encode("the cat sat")]


CASES = [(1, "auto"), (2, "shm"), (2, "zmq"), (3, "zmq")]


@pytest.mark.slow
@pytest.mark.parametrize("n,transport", CASES, ids=[f"{n}shard-{t}" for n, t in CASES])
@pytest.mark.parametrize("kind", ["dflash", "classic"])
def test_speculative_equals_plain(target, dflash, near, n, transport, kind):
    before = layersplit_shm()
    draft = dflash if kind == "dflash" else near
    with Coordinator(_cfg(target, n, draft, transport=(transport,))) as coord:
        assert coord.draft_info["kind"] == kind
        accepted = []
        for prompt in _prompts(coord.tokenizer):
            for params in (GREEDY, SAMPLED):
                plain = coord.generate(prompt, params, use_cache=False, speculative=False)
                spec = coord.generate(prompt, params, use_cache=False)
                assert spec.tokens == plain.tokens
                assert plain.acceptance_length is None and spec.acceptance_length >= 1.0
                accepted.append(spec.acceptance_length)
        if kind == "classic":  # the near draft is right often: whole runs of drafts were kept
            assert max(accepted) > 1.5
        assert len(shard_children()) == n + 1
    assert shard_children() == []
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_plain_and_speculative_equal_the_reference(target, near):
    ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
    prompt = _prompts(ref.tokenizer)[0]
    want = ref.generate(prompt, GREEDY).tokens
    with Coordinator(_cfg(target, 2, near)) as coord:
        assert coord.generate(prompt, GREEDY, use_cache=False).tokens == want


@pytest.mark.slow
def test_feature_rows_come_from_the_right_shards(target, dflash):
    """The draft's rows are bit-equal to the reference's rows of the tapped layers (layer 1 from
    shard 0, layer 4 from shard 1) at every committed position."""
    ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
    prompt = _prompts(ref.tokenizer)[0]
    with Coordinator(_cfg(target, 2, dflash)) as coord:
        assert [s.get("transport_out") for s in coord.shard_info()] == ["shm", "none"]
        out = coord.generate(prompt, GREEDY, use_cache=False)
        committed = len(prompt) + len(out.tokens) - 1
        reply = coord.draft_request(message("draft_features", start=0, end=committed))
        rows = np.frombuffer(reply["_frames"][0].buffer, dtype=np.float32).reshape(committed, -1)
    seq = prompt + out.tokens[:-1]
    ckpt = open_checkpoint(target)
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 256, taps=(1, 4))
    want = []
    for a, b in prefill_chunks(prompt, 0, len(prompt), CHUNK, ref.eos_ids):
        taps = {}
        ex.run(torch.tensor(prompt[a:b]), a, taps=taps)
        want.append(torch.cat([taps[1], taps[4]], dim=-1))
    for p in range(len(prompt), committed):  # decoded rows: one at a time, as decode steps
        taps = {}
        ex.run(torch.tensor([seq[p]]), p, taps=taps)
        want.append(torch.cat([taps[1], taps[4]], dim=-1))
    want = torch.cat(want).numpy()
    assert rows.shape == want.shape
    assert np.array_equal(rows, want)


@pytest.mark.slow
def test_restored_prefix_keeps_speculating(target, dflash, tmp_path):
    """RAM and disk hits (after a restart) restore the draft's feature rows with the KV: the
    rows are bit-equal, speculation goes on at once, the output is unchanged."""
    cfg = _cfg(target, 2, dflash, kv_cache_dir=str(tmp_path))
    with Coordinator(cfg) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        n = len(prompt)
        cold = coord.generate(prompt, GREEDY)
        rows_cold = coord.draft_request(message("draft_features", start=0, end=n))
        ram = coord.generate(prompt, GREEDY)
        assert ram.cache_tier == "ram" and ram.cached_tokens == n
        assert ram.tokens == cold.tokens and ram.acceptance_length == cold.acceptance_length
    with Coordinator(cfg) as coord:
        disk = coord.generate(prompt, GREEDY)
        assert disk.cache_tier == "disk" and disk.cached_tokens == n
        assert disk.tokens == cold.tokens
        assert disk.acceptance_length == cold.acceptance_length  # speculation went on
        rows = coord.draft_request(message("draft_features", start=0, end=n))
        assert bytes(rows["_frames"][0].buffer) == bytes(rows_cold["_frames"][0].buffer)
        # a longer prompt sharing the prefix restores it and speculates over the rest
        longer = prompt + coord.tokenizer.encode(" and the dog")
        assert coord.generate(longer, GREEDY).tokens == coord.generate(
            longer, GREEDY, use_cache=False, speculative=False).tokens


# ---- faults ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_draft_killed_mid_request_generation_goes_on(target, near):
    before = layersplit_shm()
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with Coordinator(_cfg(target, 2, near)) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        want = coord.generate(prompt, params, speculative=False, use_cache=False).tokens
        progress = Progress()
        stream = coord.stream(prompt, params, progress, use_cache=False)
        got = [d.token for _, d in zip(range(5), stream)]
        pid = coord._draft_proc.pid
        os.kill(pid, signal.SIGKILL)
        got += [d.token for d in stream if d.token >= 0]
        assert got == want
        assert coord.draft is None and "draft" in coord.draft_down
        assert wait_gone([pid]) == []
        again = coord.generate(prompt, params, use_cache=False)  # plain from now on
        assert again.tokens == want and again.acceptance_length is None
    assert shard_children() == []
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_draft_killed_with_speculation_required_fails_clearly(target, near):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with Coordinator(_cfg(target, 2, near, spec_required=True)) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        stream = coord.stream(prompt, params, Progress(), use_cache=False)
        next(stream)
        os.kill(coord._draft_proc.pid, signal.SIGKILL)
        with pytest.raises(ShardFailure, match="draft"):
            for _ in stream:
                pass
    assert shard_children() == []


@pytest.mark.slow
def test_malformed_draft_frames_are_refused_without_desync(target, dflash):
    with Coordinator(_cfg(target, 2, dflash, transport=("zmq",))) as coord:
        prompt = _prompts(coord.tokenizer)[0]
        want = coord.generate(prompt, GREEDY, use_cache=False)
        # a propose with payload frames it cannot have, one with a missing field, garbage
        for frames, extra in (([b"\x01\x02\x03", b"x"], {}), ([], {"drop": "token"})):
            msg = message("propose", pos=len(prompt), n=3, token=1, start=0, sync=0)
            msg.pop(extra.get("drop", "-"), None)
            with pytest.raises(DraftError):
                coord.draft_request(msg, frames)
        coord.draft.sock.send(b"\xc1 not msgpack")
        again = coord.generate(prompt, GREEDY, use_cache=False)
        assert again.tokens == want.tokens
        assert again.acceptance_length == want.acceptance_length
        assert coord.draft is not None


def test_configuring_an_incompatible_draft_fails_before_serving(target, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(ShardFailure, match="vocab_size 300"):
        Coordinator(_cfg(target, 2, other)).start()
    assert shard_children() == []


@pytest.mark.slow
@pytest.mark.network
def test_bundled_draft_on_the_default_model(default_model, tmp_path):
    """The trained draft: lossless, real acceptance (a random draft commits 1.0 tokens per
    verify; this one about 1.7 on this prompt), and the same acceptance after a restart restores
    the prompt from disk."""
    cfg = RuntimeConfig(model=str(default_model), devices=("cpu", "cpu"), draft="default",
                        max_context=512, threads=1, kv_cache_dir=str(tmp_path))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with Coordinator(cfg) as coord:
        tok = coord.tokenizer
        prompt = tok.encode_chat([{"role": "user", "content":
                                   "What are the main causes of the French Revolution?"}])
        plain = coord.generate(prompt, params, use_cache=False, speculative=False)
        spec = coord.generate(prompt, params)
        assert spec.tokens == plain.tokens and "Revolution" in spec.text
        assert spec.acceptance_length > 1.4
    with Coordinator(cfg) as coord:
        again = coord.generate(prompt, params)
        assert again.cache_tier == "disk" and again.tokens == plain.tokens
        assert again.acceptance_length == spec.acceptance_length
