"""Decode lookahead (`runtime.batching.Batcher._send_ahead`, `shards.decode_ahead`): each
decode step is sent before the token it takes is back, and the first shard takes that token
where the last one posted it (`ipc.token_board`: its own memory on one shard, memory the two
share on a split runtime). Tokens and the logits of every generated position equal the
reference engine's, greedy and sampled, alone and batched, with 1, 2 and 3 shards on both
transports, for a dense and a hybrid model (whose recurrent state takes each row once); a step
sent past a stop token is dropped and its slot serves the next request exactly; a hybrid
sequence whose next step is not the one sent ahead runs again from its tokens; a `prev` the
first shard cannot honour is refused by name, and one whose step failed on its way fails at
once."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
from layersplit.ipc.messages import message, segment
from layersplit.ipc.sockets import send
from layersplit.runtime import request_flow
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Progress, StepRequest, collect
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import (
    assert_same_logits,
    assert_same_run,
    layersplit_shm,
    run_logged,
    send_raw_step,
)

CHUNK = 16
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)


def _cfg(model, n: int = 1, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, threads=1, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=256)


FAMILIES = ["llama", "qwen3_5"]  # a dense model's and a hybrid one's (a recurrent state)


@pytest.fixture(scope="module")
def models(tiny_llama, hybrid_models):
    return {"llama": tiny_llama, "qwen3_5": hybrid_models["qwen3_5"]}


@pytest.fixture(scope="module")
def references(models, reference):
    return {"llama": reference, "qwen3_5": ReferenceEngine(
        models["qwen3_5"], prefill_chunk=CHUNK, max_context=256)}


def _prompt(reference, i: int = 0) -> list[int]:
    text = f"<|im_start|>user\nthe cat sat on the mat, said dog {i}<|im_end|>\n"
    return reference.tokenizer.encode(text + "<|im_start|>assistant\n")


# one shard has no edge for a transport to carry (`runtime.placement`): one run of it, not two
CHAINS = [(1, "shm"), (2, "shm"), (2, "zmq"), (3, "shm"), (3, "zmq")]


@pytest.mark.slow
@pytest.mark.parametrize("shards,transport", CHAINS, ids=[f"{t}-{n}" for n, t in CHAINS])
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_logits_equal_the_reference(models, references, family, shards, transport):
    before = layersplit_shm()
    reference = references[family]
    prompt = _prompt(reference)
    with Coordinator(_cfg(models[family], shards, transport=(transport,))) as coord:
        assert coord.batcher.look_ahead and coord.board == (shards > 1)
        for p in (GREEDY, SAMPLED):
            sent = coord.batcher.stats.ahead
            got = run_logged(coord, prompt, p)
            assert_same_run(got, run_logged(reference, prompt, p), f"temperature {p.temperature}")
            assert len(set(got[0].tokens)) > 8  # (a model that repeats one token shows nothing)
            # every token after the first decode step's came from a lookahead step
            assert coord.batcher.stats.ahead - sent == p.max_tokens - 2
            assert coord.batcher.stats.ahead_dropped == 0
        coord.batcher.check()
    assert layersplit_shm() - before == set()


def _first_new(tokens: list[int], at: int) -> int:
    """The first index from `at` whose token did not come before it (a stop token there ends
    the sequence there)."""
    return next(i for i in range(at, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_with_stops_equals_each_alone(models, references, family, shards):
    """Three sequences decode ahead in one micro-batch; two stop early on a stop token (their
    lookahead steps are dropped: a hybrid slot's state then took a row past the sequence's
    end), and the slots they free serve later requests exactly."""
    reference = references[family]
    prompts = [_prompt(reference, i) for i in range(5)]
    alone = [reference.generate(p, GREEDY).tokens for p in prompts]
    stops = [_first_new(alone[0], 4), _first_new(alone[2], 9)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[alone[0][stops[0]]]),
              SAMPLED,
              SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[alone[2][stops[1]]]),
              GREEDY, SAMPLED]
    want = [reference.generate(p, sp).tokens for p, sp in zip(prompts, params)]
    assert [len(want[0]), len(want[2])] == stops and max(stops) < 20
    with Coordinator(_cfg(models[family], shards, max_seqs=3, micro_batches=1)) as coord:
        got = coord.generate_batch(prompts, params, use_cache=False)
        assert [r.tokens for r in got] == want
        stats = coord.batcher.stats
        assert stats.ahead > 0 and stats.ahead_dropped >= 2, stats
        assert stats.widest == 3
        coord.batcher.check()
        assert not coord.batcher.requests and not coord.batcher.steps
        assert coord.batcher.sched.reclaimable_blocks == coord.batcher.sched.total_blocks


@pytest.mark.slow
def test_off_no_step_goes_ahead(tiny_llama, reference):
    prompt = _prompt(reference)
    want = reference.generate(prompt, GREEDY).tokens
    for n in (1, 2):
        with Coordinator(_cfg(tiny_llama, n, decode_ahead=False)) as coord:
            assert not coord.batcher.look_ahead and not coord.board
            assert coord.generate(prompt, GREEDY, use_cache=False).tokens == want
            assert coord.batcher.stats.ahead == 0


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
def test_a_prev_the_shard_cannot_honour_is_refused_by_name(tiny_llama, reference, shards):
    """A lookahead segment names the step whose token it takes: one that did not sample the
    slot's last token (a step done with, on a split runtime: no wait), a step not before it, or
    a segment of several rows, is refused before any compute, and the runtime goes on
    unchanged."""
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    prompt = _prompt(reference)
    with Coordinator(_cfg(tiny_llama, shards, max_seqs=2)) as coord:
        want = coord.generate(prompt, GREEDY).tokens
        done = coord._new_sid() - 1  # (a step of that request: slot 0's)
        cases = [
            ([segment(1, 4, 1, greedy, prev=done)], [0],
             (f"prev={done}, but slot 1's last sampled token came from step -1 (step {done} "
              "did not sample it)")),
            ([segment(0, 4, 1, greedy, prev=10 ** 9)], [0],
             "prev=1000000000 is not an earlier step than"),
            ([segment(0, 4, 2, greedy, prev=1)], [0, 0], "prev=1 on a segment of 2 rows"),
        ]
        for seqs, ids, why in cases:
            sid = send_raw_step(coord, seqs, ids)
            with pytest.raises(ShardFailure, match=re.escape(why)):
                coord._wait(lambda s, m: False, time.monotonic() + 30, f"step {sid}", sid)
            assert coord.failed is None
        assert coord.generate(prompt, GREEDY).tokens == want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_no_step_goes_ahead_of_a_prefill_chunk(tiny_models, hybrid_models, family):
    """A prompt one token past a chunk boundary ends in a one-token prefill chunk whose step
    asks for the logits (a prefix-cache point): no step may follow it ahead (the first decode
    step differs from it and would compute its row again: wrong for a hybrid model's recurrent
    state). The output equals the reference's, cold and from the cache."""
    model = {**tiny_models, **hybrid_models}[family]
    reference = ReferenceEngine(model, prefill_chunk=CHUNK, max_context=256)
    prompt = (_prompt(reference, 1) * 3)[:2 * CHUNK + 1]
    want = reference.generate(prompt, GREEDY).tokens
    with Coordinator(_cfg(model)) as coord:
        assert coord.batcher.look_ahead
        assert coord.batcher.recurrent == (family == "qwen3_5")
        for tier in ("none", "ram"):
            got = coord.generate(prompt, GREEDY)
            assert got.tokens == want and got.cache_tier == tier
        assert coord.batcher.stats.ahead_dropped == 0


@pytest.mark.slow
def test_a_stale_sequence_cancelled_before_its_steps_are_back(models, references, monkeypatch):
    """A hybrid sequence goes stale (its next step is not the one sent ahead) and its client
    goes while the lookahead step is still in flight: it ends once that step is back, runs
    nothing again, and leaves the runtime clean for the next request."""
    reference = references["qwen3_5"]
    prompt = _prompt(reference)
    want = reference.generate(prompt, GREEDY).tokens
    with Coordinator(_cfg(models["qwen3_5"], 1, prefix_cache=False)) as coord:
        changed = _reseeded_once(monkeypatch, len(prompt) + 6)
        req = coord.submit(prompt, GREEDY, Progress(), use_cache=False)
        stream = coord.deltas(req)
        for _ in stream:
            if req.stale_state:
                assert req.in_flight > 0
                break
        stream.close()  # (the client goes: the request is cancelled)
        assert changed and req.cancelled, req
        assert coord.generate(prompt, GREEDY, use_cache=False).tokens == want
        stats = coord.batcher.stats
        assert req.done and stats.stale_restarts == 0 and stats.ahead_dropped == 1, stats
        coord.batcher.check()
        assert not coord.batcher.requests and not coord.batcher.steps


@pytest.mark.slow
def test_a_hybrid_sequence_with_a_drafter_goes_token_by_token(models, references, tmp_path):
    """On a hybrid model with a DFlash draft, a sequence that may speculate never goes ahead,
    even where the measured policy makes its steps plain (a random draft's proposals are
    never accepted): were the policy to turn to speculating, it would ask for the row sent
    ahead again. One asked not to speculate, which still feeds the draft its rows, goes
    ahead. Both equal the reference."""
    from layersplit.draft.dflash import write_random_dflash
    from layersplit.shards.model_config import read_hf_config

    reference = references["qwen3_5"]
    prompt = _prompt(reference)
    want = reference.generate(prompt, GREEDY).tokens
    draft = write_random_dflash(read_hf_config(models["qwen3_5"]), tmp_path, layers=1,
                                taps=[1, 4], block_size=4)
    with Coordinator(_cfg(models["qwen3_5"], 1, draft=str(draft),
                          spec_policy="measured")) as coord:
        assert coord.feeding
        stats = coord.batcher.stats
        first = coord.generate(prompt, GREEDY, use_cache=False)
        assert first.tokens == want and first.spec_off_steps, first
        assert stats.ahead == 0, stats
        progress = Progress()
        plain = collect(coord.stream(prompt, GREEDY, progress, use_cache=False,
                                     speculative=False), progress, len(prompt))
        assert plain.tokens == want
        assert stats.ahead == GREEDY.max_tokens - 2 and stats.stale_restarts == 0, stats


def _reseeded_once(monkeypatch, at: int) -> list[int]:
    """Every sequence program's decode step at position `at`, the first one only, asks for
    another seed than the step before it (a step the lookahead did not send: its output is
    dropped); returns the list that counts the steps changed."""
    changed: list[int] = []
    make = request_flow.sequence_program

    def wrapped(*args, **kw):
        prog = make(*args, **kw)
        try:
            item = next(prog)
            while True:
                if not changed and isinstance(item, StepRequest) and item.pos == at \
                        and len(item.tokens) == 1 and item.sample is not None:
                    item = dataclasses.replace(item, seed=item.seed + 1)
                    changed.append(at)
                item = prog.send((yield item))
        except StopIteration as e:
            return e.value
        finally:
            prog.close()

    monkeypatch.setattr(request_flow, "sequence_program", wrapped)
    return changed


@pytest.mark.slow
@pytest.mark.parametrize("family,shards,cache", [("llama", 1, False), ("qwen3_5", 1, False),
                                                 ("qwen3_5", 2, True)])
def test_a_step_other_than_the_one_sent_ahead(models, references, family, shards, cache,
                                              monkeypatch):
    """After a lookahead step went out, the program asks for another step (the same row with
    another seed, greedy: the same token): the lookahead's output is dropped. A dense model
    computes the row again in that step; a hybrid model's recurrent state took the row
    already, and would take it twice: that sequence runs again from its tokens (a re-prefill,
    not a preemption), once every step of it is back (on 2 shards the first may still hold the
    lookahead step; the cache on or off). Either way the tokens and the logits equal the
    reference's."""
    reference = references[family]
    prompt = _prompt(reference)
    want = run_logged(reference, prompt, GREEDY)
    with Coordinator(_cfg(models[family], shards, prefix_cache=cache)) as coord:
        changed = _reseeded_once(monkeypatch, len(prompt) + 6)
        got = run_logged(coord, prompt, GREEDY)
        assert changed and got[0].tokens == want[0].tokens
        stats = coord.batcher.stats
        # (dense: the reseeded step's own lookahead, which took its seed, is dropped too)
        assert stats.ahead > 0 and stats.ahead_dropped == (2 if family == "llama" else 1), stats
        assert stats.stale_restarts == (family == "qwen3_5") and stats.reprefills == 0, stats
        assert stats.preemptions == 0, stats
        if family == "llama":
            assert_same_logits(got[1], want[1], family)
        else:  # (the rows after the re-prefill come from a prefill chunk, not decode steps)
            np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-4)
        coord.batcher.check()
        assert coord.generate(prompt, GREEDY).tokens == want[0].tokens


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
def test_a_pool_too_small_for_every_lookahead_skips_it(tiny_llama, reference, shards):
    """Two sequences cross a KV block boundary on the same step with one block free: the
    lookahead is not sent (the pool would run out between them); the step goes out as usual,
    the younger sequence is swapped out and back, and both outputs equal each alone."""
    prompt = _prompt(reference)[:3]
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    want = reference.generate(prompt, p).tokens
    with Coordinator(_cfg(tiny_llama, shards, max_seqs=2, kv_block=4, kv_blocks=5,
                          kv_host_blocks=4, prefix_cache=False)) as coord:
        got = coord.generate_batch([prompt, prompt], [p, p])
        assert [r.tokens for r in got] == [want, want]
        stats = coord.batcher.stats
        assert stats.ahead > 0 and stats.swapped_out >= 1, stats
        coord.batcher.check()
        assert coord.batcher.sched.reclaimable_blocks == coord.batcher.sched.total_blocks


@pytest.mark.slow
def test_a_held_step_fails_at_once_when_its_step_fails_and_never_takes_the_shard_down(
        tiny_llama, reference):
    """On a split runtime the first shard holds a lookahead step until the last shard posts the
    tokens of the step it follows. When that step fails where the last shard never sees it,
    the coordinator voids it on its error: the held step fails at once, naming it (not after
    AHEAD_WAIT_S). A held step with a segment no shard can run (a slot outside the pool) is
    refused by name once its tokens come, and the shard serves on."""
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    prompt = _prompt(reference)
    with Coordinator(_cfg(tiny_llama, 2, prefix_cache=False)) as coord:
        want = coord.generate(prompt, GREEDY).tokens
        coord.batcher.sched.hold_slot(0, 8, new=True)
        # a fails on the first shard (a token id outside the vocabulary); b, behind it, is held
        a = coord.send_step([(0, StepRequest([10 ** 6], 4, GREEDY, 0), None)])
        b = coord.send_step([(0, StepRequest([0], 5, GREEDY, 0, prev=a), None)])
        for sid, why in [(a, "token id outside the vocabulary"), (b, f"prev={a}, but slot 0")]:
            while sid not in coord._done:  # (b: within the step's deadline, not AHEAD_WAIT_S)
                coord.wait_steps()
            with pytest.raises(ShardFailure, match=re.escape(why)) as err:
                coord.step_outputs(sid)
        assert f"(step {a} failed)" in str(err.value)
        # c waits on the last shard for a grammar mask sent after it (`late_mask`); d, held
        # behind it, has a second segment in slot 99
        c = send_raw_step(coord, [segment(0, 4, 1, {**greedy, "late_mask": True})], [5])
        d = send_raw_step(coord, [segment(0, 5, 1, greedy, prev=c),
                                  segment(99, 5, 1, greedy, prev=c)], [0, 0])
        send(coord.shards[-1].sock, message("mask", sid=c, seg=0, mask=None))
        # c's result (the last shard's) and d's refusal (the first shard's, once c's token is
        # posted) come in either order: a wait for one drops an error about the other (these
        # steps are not tracked), so one wait takes both
        got = {}

        def c_result(s, m) -> bool:
            if m["type"] == "result" and m["sid"] == c:
                got["c"] = m
            return False

        with pytest.raises(ShardFailure, match="slot 99 is outside"):
            coord._wait(c_result, time.monotonic() + 30, f"step {d}", d)
        if "c" not in got:  # (d's refusal came first)
            got["c"], _ = coord._wait(lambda s, m: m["type"] == "result" and m["sid"] == c,
                                      time.monotonic() + 30, f"step {c}", c)
        assert got["c"]["outs"][0]["token"] is not None
        assert coord.failed is None
        assert coord.generate(prompt, GREEDY).tokens == want
