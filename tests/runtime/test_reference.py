"""The reference engine: chunked prefill, decode, stop tokens/strings, max tokens, context."""

from __future__ import annotations

import torch
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.chunking import cut_points, prefill_chunks
from layersplit.shards.sampling import SamplingParams


def test_chunked_prefill_close_to_single_chunk(tiny_llama):
    a = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    b = ReferenceEngine(tiny_llama, prefill_chunk=1024, max_context=256)
    ids = list(range(3, 103))
    assert (a.logits(ids) - b.logits(ids)).abs().max().item() < 1e-5


def test_chunks_split_at_multiples_and_turn_ends():
    toks = [5] * 10 + [2] + [5] * 30
    assert cut_points(toks, 16, {2}) == [11, 16, 32]
    assert prefill_chunks(toks, 0, 41, 16, {2}) == [(0, 11), (11, 16), (16, 32), (32, 41)]
    assert prefill_chunks(toks, 16, 41, 16, {2}) == [(16, 32), (32, 41)]


def test_greedy_generation_and_limits(tiny_llama):
    eng = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=128)
    prompt = eng.tokenizer.encode("the cat sat on the mat " * 3)
    r = eng.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(r.tokens) == 12 and r.finish_reason == "length"
    r2 = eng.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert r2.tokens == r.tokens
    # a stop token ends generation without emitting it
    stop_tok = r.tokens[5]
    r3 = eng.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,)))
    assert r3.finish_reason == "stop" and stop_tok not in r3.tokens
    assert r3.tokens == r.tokens[: r.tokens.index(stop_tok)]
    # a stop string truncates the text
    piece = eng.tokenizer.decode(r.tokens[6:8])
    if piece.strip():
        r4 = eng.generate(prompt, SamplingParams(max_tokens=12, stop=(piece,), ignore_eos=True))
        assert r4.finish_reason == "stop" and piece not in r4.text
    # the context bounds generation
    r5 = eng.generate(prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
    assert len(prompt) + len(r5.tokens) == 128 and r5.finish_reason == "length"
    assert eng.generate(prompt, SamplingParams(max_tokens=0)).tokens == []


def test_seeded_sampling_reproduces(tiny_llama):
    eng = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=128)
    prompt = eng.tokenizer.encode("hello there")
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    a, b = eng.generate(prompt, p), eng.generate(prompt, p)
    c = eng.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=6,
                                            ignore_eos=True))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_logits_rows_match_decode(tiny_llama):
    """The last row of a prefill and a decode step see the same context."""
    eng = ReferenceEngine(tiny_llama, prefill_chunk=8, max_context=64)
    ids = list(range(3, 23))
    full = eng.logits(ids)
    step = eng.executor.run(torch.tensor([ids[-1]]), len(ids) - 1)
    assert (full[-1] - step[0]).abs().max().item() < 1e-5
