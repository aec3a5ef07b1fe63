"""Continuous batching: every sequence of a batch gets exactly the tokens it gets alone (CPU
shards run each sequence's segment as they would alone), with prompts of mixed lengths, prefix
cache hits, speculation and sampling in one batch, more requests than KV slots, and
cancellation; the scheduler holds no slot or block afterwards."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.generate import Progress
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import layersplit_shm

CHUNK = 16
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _params(i: int) -> SamplingParams:
    if i % 3 == 2:  # some sampled, each with its own seed
        return SamplingParams(max_tokens=10 + i, ignore_eos=True, temperature=0.9, top_p=0.95,
                              seed=100 + i)
    return SamplingParams(max_tokens=10 + i, ignore_eos=True)


def _prompts(tok) -> list[list[int]]:
    words = "the cat sat on the mat and looked at the dog who ran away from the big red ball"
    texts = [" ".join(words.split()[: 2 + 3 * i]) for i in range(8)]
    out = [tok.encode(TURN.format(t)) for t in texts]
    out[5] = out[5] * 2  # several prefill chunks, pipelined through the shards
    return out


def _check_idle(c: Coordinator) -> None:
    s = c.batcher.sched
    s.check()
    assert not s.running and not s.waiting and not c.batcher.requests
    assert s.reclaimable_blocks == s.total_blocks  # (held prefixes go when needed)
    assert not c.batcher.steps and not c._in_flight and not c._done


@pytest.mark.slow
@pytest.mark.parametrize("n,transport,spec_seqs", [(2, "shm", 3), (3, "zmq", 1)])
def test_batch_of_8_equals_each_alone(target, dflash, tmp_path, n, transport, spec_seqs):
    before = layersplit_shm()
    cfg = RuntimeConfig(model=str(target), devices=("cpu",) * n, transport=(transport,),
                        prefill_chunk=CHUNK, max_context=256, max_seqs=4, micro_batches=2,
                        threads=1, draft=str(dflash), draft_device="cpu", spec_max_seqs=spec_seqs,
                        kv_cache_dir=str(tmp_path / "kv"))
    with Coordinator(cfg) as c:
        prompts = _prompts(c.tokenizer)
        params = [_params(i) for i in range(len(prompts))]
        alone = [c.generate(p, sp, use_cache=False).tokens for p, sp in zip(prompts, params)]
        # warm the cache: prompt 0 becomes an exact hit, prompt 6 a partial one (its first
        # turn is cached, the batch sends it with a second turn appended)
        c.generate(prompts[0], params[0])
        c.generate(prompts[6], params[6])
        prompts[6] = prompts[6] + [5] + c.tokenizer.encode(TURN.format("and then"))
        alone[6] = c.generate(prompts[6], params[6], use_cache=False).tokens
        spec = [None if i != 3 else False for i in range(len(prompts))]
        steps_before = c.batcher.stats.steps
        got = c.generate_batch(prompts, params, speculative=spec)
        stats = c.batcher.stats
        assert [r.tokens for r in got] == alone
        assert got[0].cache_tier == "ram" and got[0].cached_tokens == len(prompts[0])
        assert got[6].cache_tier == "ram" and 0 < got[6].cached_tokens < len(prompts[6])
        speculated = sum(r.acceptance_length is not None for r in got)
        assert speculated >= min(spec_seqs, 2)  # (3: several sequences speculated at once)
        if spec_seqs > 1:  # sampled sequences speculated too (spec_sampling: coupled draws)
            assert any(got[i].acceptance_length is not None for i in range(2, 8, 3))
        assert stats.widest == 2, "steps carried several sequences (2 per micro-batch)"
        assert stats.steps - steps_before < sum(len(r.tokens) for r in got)
        assert stats.most_in_flight >= 2, "micro-batches were in flight together"
        _check_idle(c)
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_cancelled_sequence_frees_its_slot_and_others_go_on(target):
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=CHUNK,
                        max_context=128, max_seqs=2, threads=1, draft="none",
                        prefix_cache=False)
    with Coordinator(cfg) as c:
        prompts = _prompts(c.tokenizer)[:3]
        params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 3
        alone = [c.generate(p, sp).tokens for p, sp in zip(prompts, params)]
        progs = [Progress() for _ in prompts]
        streams = [c.stream(p, sp, pr) for p, sp, pr in zip(prompts, params, progs)]
        next(streams[0])  # two slots: the third request waits for one
        assert len(c.batcher.sched.running) == 2 and len(c.batcher.sched.waiting) == 1
        first = next(iter(c.batcher.sched.running))
        streams[0].close()  # cancelled: its slot goes to the waiting request
        while c.batcher.sched.waiting:
            c.batcher.run_once()
        assert first not in c.batcher.sched.running
        for st in streams[1:]:
            for _ in st:
                pass
        assert progs[1].generated == alone[1] and progs[2].generated == alone[2]
        assert len(progs[0].generated) == 1
        while c.batcher.busy:  # a step of the cancelled one may still be in flight
            c.batcher.run_once()
        _check_idle(c)


@pytest.mark.slow
def test_long_prompt_chunks_overlap_in_the_chain(target):
    """One long prompt alone: its prefill chunks follow each other into the chain without
    waiting for results (several steps in flight), and the output is unchanged."""
    cfg = RuntimeConfig(model=str(target), devices=("cpu",) * 3, prefill_chunk=8,
                        max_context=192, max_seqs=2, threads=1, draft="none",
                        prefix_cache=False)
    ref = ReferenceEngine(target, prefill_chunk=8, max_context=192)
    prompt = _prompts(ref.tokenizer)[7] * 2
    assert len(prompt) > 8 * 8
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    with Coordinator(cfg) as c:
        assert c.generate(prompt, p).tokens == ref.generate(prompt, p).tokens
        assert c.batcher.stats.most_in_flight >= 3
        _check_idle(c)


@pytest.mark.slow
def test_random_admissions_and_cancels(target):
    """Random interleavings of submits, cancels and steps on a real 2-shard batch (3 slots, so
    requests queue; RAM prefix cache on, so repeats hit it): no slot or block leaks, every
    request ends, and every one not cancelled gets exactly its tokens run alone."""
    cfg = RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=8,
                        max_context=128, max_seqs=3, micro_batches=2, threads=1, draft="none")
    with Coordinator(cfg) as c:
        prompts = [p[: 6 + 7 * i] for i, p in enumerate(_prompts(c.tokenizer)[2:8])]
        params = [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True) for i in range(6)]
        alone = [c.generate(p, sp, use_cache=False).tokens for p, sp in zip(prompts, params)]

        @settings(max_examples=12, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(st.tuples(st.sampled_from(["submit", "cancel", "step", "step"]),
                                  st.integers(0, 5)), min_size=4, max_size=30))
        def run(ops):
            live = []  # (prompt index, request, progress, cancelled)
            for op, i in ops:
                if op == "submit":
                    pr = Progress()
                    live.append([i, c.submit(prompts[i], params[i], pr), pr, False])
                elif op == "cancel" and live:
                    entry = live[i % len(live)]
                    c.batcher.cancel(entry[1])
                    entry[3] = True
                elif c.batcher.busy:
                    c.batcher.run_once()
                c.batcher.check()
            while c.batcher.busy:
                c.batcher.run_once()
                c.batcher.check()
            for i, req, pr, cancelled in live:
                assert req.done and req.error is None
                if not cancelled:
                    assert pr.generated == alone[i]
                else:
                    assert pr.generated == alone[i][:len(pr.generated)]
            _check_idle(c)

        run()
