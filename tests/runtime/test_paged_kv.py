"""Paged KV end to end: the shards' KV pools read and written through the block
tables the coordinator hands out (`runtime.block_manager`, `shards.paged_kv`).

- paged output equals the contiguous reference engine bit for bit, with blocks of 16 tokens,
  prefill chunks of 12 and a 37-token prompt (chunks and restores end mid-block), two
  sequences growing at once (their tables interleave), 1-3 shards, shm and zmq, and after a
  RAM and a disk restore;
- more sequences than `max_seqs x max_context` could hold contiguously run at once in a pool of
  one max_context (an 8,192-token pool holding 6,000 + 7 x 300-token prompts, scaled down to
  a 512-token pool, 300 + 7 x 20 for a tiny model);
- a pool that runs out mid-decode preempts a sequence, which resumes to the same tokens; every
  block is back at the end;
- bad `blocks` / `copy` fields are refused by name.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from layersplit.ipc.messages import message, segment
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, drive, run_logged, shard_children

CHUNK, BLOCK = 12, 16
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)


def _cfg(model, n: int, **kw) -> RuntimeConfig:
    kw = {"max_context": 256, "prefill_chunk": CHUNK, "kv_block": BLOCK, **kw}
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, threads=1, **kw)


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=512)


@pytest.fixture(scope="module")
def prompts(ref):
    ids = ref.tokenizer.encode("the quick brown fox jumps over the lazy dog and runs " * 8)
    return ids[:37], ids[3:32]


@pytest.mark.slow
@pytest.mark.parametrize("n,transport", [(2, "zmq"), (3, "shm")])  # (1 shard and the other
# transports: tests/runtime/test_split_exactness.py, through the same paged path)
def test_paged_equals_reference(tiny_llama, ref, prompts, tmp_path, n, transport):
    want = {i: [run_logged(ref, p, params) for params in (GREEDY, SAMPLED)]
            for i, p in enumerate(prompts)}
    cfg = _cfg(tiny_llama, n, transport=(transport,), kv_cache_dir=str(tmp_path))
    with Coordinator(cfg) as c:
        # two sequences at once: their block tables grow interleaved (no slot's rows are
        # contiguous in the pool)
        got = c.generate_batch(list(prompts), [GREEDY, SAMPLED], use_cache=False)
        for i, (r, params) in enumerate(zip(got, (GREEDY, SAMPLED))):
            assert r.tokens == want[i][params is SAMPLED][0].tokens, f"sequence {i}"
        for i, p in enumerate(prompts):
            assert_same_run(run_logged(c, p, GREEDY), want[i][0], f"cold {i}")
        got = run_logged(c, prompts[0], SAMPLED)  # an exact RAM hit: 37 rows, 2 blocks + 5
        assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", 37)
        assert_same_run(got, want[0][1], "RAM restore")
        assert c.batcher.sched.reclaimable_blocks == c.batcher.sched.total_blocks
        c.batcher.sched.check()
    with Coordinator(cfg) as c:  # a restart: the disk tier, into blocks of a new pool
        got = run_logged(c, prompts[0], GREEDY)
        assert (got[0].cache_tier, got[0].cached_tokens) == ("disk", 37)
        assert_same_run(got, want[0][0], "disk restore")
    assert shard_children() == []


@pytest.mark.slow
def test_more_sequences_than_fit_contiguously(tiny_llama, ref):
    """A pool of 512 tokens per shard (32 blocks of 16), max_context 512, 8 slots: one
    300-token prompt and seven 20-token prompts run at once (contiguous slots would need
    8 x 512 rows); each output equals the prompt's alone, logits bit for bit."""
    text = ref.tokenizer.encode("a long agentic conversation about many things, " * 40)
    long = text[:300]
    shorts = [text[7 * i + 1:7 * i + 21] for i in range(7)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [run_logged(ref, p, params) for p in [long, *shorts]]
    cfg = _cfg(tiny_llama, 2, max_context=512, max_seqs=8, kv_blocks=32, prefix_cache=False)
    with Coordinator(cfg) as c:
        info = c.shard_info()
        assert [s["kv_capacity_tokens"] for s in info] == [512, 512]
        progress = [Progress(logits=[]) for _ in want]
        got = c.generate_batch([long, *shorts], [params] * 8, progress=progress)
        assert c.batcher.stats.widest >= 2  # they ran together
        for i, (r, pr) in enumerate(zip(got, progress)):
            assert_same_run((r, np.stack(pr.logits)), want[i], f"sequence {i}")
        assert c.batcher.sched.free_blocks == 32
        c.batcher.sched.check()


@pytest.mark.slow
def test_pool_exhaustion_preempts_and_resumes(target):
    """6 blocks of 16 tokens (96 rows) for three sequences of 20-token prompts generating 24
    tokens each (44 rows, 3 blocks each): the pool runs out mid-decode, the youngest is
    preempted and runs again from its prompt and generated tokens; every output equals the
    prompt's alone and every block is free at the end."""
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(20)] for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with Coordinator(_cfg(target, 2, max_context=96, max_seqs=1, kv_blocks=6)) as c:
        alone = [c.generate(p, params, use_cache=False).tokens for p in prompts]
    with Coordinator(_cfg(target, 2, max_context=128, max_seqs=3, kv_blocks=6)) as c:
        got = c.generate_batch(prompts, [params] * 3)
        assert [r.tokens for r in got] == alone
        assert c.batcher.stats.preemptions >= 1
        sched = c.batcher.sched
        assert sched.reclaimable_blocks == sched.total_blocks == 6 and not sched.running
        sched.check()
        # a sequence that alone cannot fit the pool fails clearly (and frees what it held)
        with pytest.raises(MemoryError, match="KV pool .* cannot hold"):
            c.generate(prompts[0], SamplingParams(max_tokens=90, ignore_eos=True))
        assert sched.reclaimable_blocks == 6
        assert [r.tokens for r in c.generate_batch(prompts[:1], [params])] == alone[:1]


@pytest.mark.slow
def test_bad_blocks_and_copies_are_refused_by_name(tiny_llama):
    with Coordinator(_cfg(tiny_llama, 2, max_seqs=3, kv_blocks=40)) as c:
        p = SamplingParams(max_tokens=4, ignore_eos=True)
        prompt = list(range(5, 30))
        want = c.generate(prompt, p).tokens
        greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
        cases = [
            (segment(0, 0, 1, blocks={"at": 0, "ids": [40]}), "blocks ids must be block ids 0..39"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": [-1]}), "blocks ids must be block ids"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": "x"}), "blocks ids must be block ids"),
            (segment(0, 0, 1, blocks={"at": 5, "ids": [1]}), "blocks at=5 outside the slot's"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": [1, 1]}), "list a block twice"),
            (segment(0, 0, 1, blocks={"at": 0}), "blocks has fields ['at'], expected at and ids"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": list(range(17))}),
             "a table of 17 blocks exceeds the 16 of max_context 256"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": [0]}, copy=[[0, 0]]),
             "copy must be [src, dst] pairs of distinct block ids 0..39"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": [0]}, copy=[[0, 99]]),
             "copy must be [src, dst] pairs"),
            (segment(0, 0, 1, blocks={"at": 0, "ids": [0]}, copy=[3]), "copy must be"),
            (segment(2, 0, 1), "rows 0..1 outside the slot's block table of 0 rows"),
            (segment(0, 10, 8, greedy, blocks={"at": 0, "ids": [3]}),
             "rows 10..18 outside the slot's block table of 16 rows"),
        ]
        for seg, why in cases:
            sid = c._new_sid()
            c._steps.send(message("step", sid=sid, seqs=[seg], act=None),
                          torch.tensor([5] * seg["n"], dtype=torch.int64))
            with pytest.raises(ShardFailure, match=re.escape(why)):
                c._wait(lambda s, m: False, time.monotonic() + 30, f"step {sid}", sid)
            assert c.failed is None
        for kind, extra in (("snap_restore", {"entries": [1]}),
                            ("snap_load", {"path": "/nowhere", "items": [], "stream": False})):
            for blocks, why in (({"at": 0, "ids": [99]}, f"{kind}: blocks ids must be"),
                                ({"ids": [1]}, f"{kind}: blocks has fields ['ids']")):
                sh = c.shards[1]
                with pytest.raises(ShardFailure, match=re.escape(why)):
                    c._call(sh, message(kind, slot=0, blocks=blocks, **extra),
                            time.monotonic() + 30)
        assert c.generate(prompt, p).tokens == want  # nothing lost
        assert [r.tokens for r in c.generate_batch([prompt] * 3, [p] * 3)] == [want] * 3


@pytest.mark.slow
def test_live_prefix_blocks_are_shared(tiny_llama, ref):
    """4 requests on one 84-token prefix (7 chunks of 12: 5 blocks of 16 and 4 rows): the 3
    that come while the first runs take its 5 full blocks by reference and copy the partial
    one; the prefix is held once, and every output equals the prompt's alone."""
    from layersplit.runtime.generate import collect

    text = ref.tokenizer.encode("one shared system prompt for every agent of the team, " * 12)
    prefix = text[:84]
    prompts = [prefix + text[90 + 4 * i:94 + 4 * i] for i in range(4)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    want = [run_logged(ref, p, params) for p in prompts]
    with Coordinator(_cfg(tiny_llama, 2, max_seqs=4, prefix_cache=False)) as c:
        progress = [Progress(logits=[]) for _ in prompts]
        reqs = [c.submit(prompts[0], params, progress[0])]
        while not progress[0].generated:  # the first one's prefill is done
            c.batcher.run_once()
        reqs += [c.submit(p, params, pr) for p, pr in zip(prompts[1:], progress[1:])]
        c.batcher.run_once()  # admits the other three
        pool = c.batcher.sched.pool
        assert c.batcher.stats.shared_tokens == 3 * 84
        assert [b for b, n in enumerate(pool.refs) if n == 4] == pool.table(reqs[0].slot)[:5]
        held = {b for t in pool.tables.values() for b in t}
        assert len(held) == sum(len(t) for t in pool.tables.values()) - 3 * 5  # held once
        c.batcher.sched.check()
        while not all(r.done for r in reqs):
            c.batcher.run_once()
        for i, (p, pr) in enumerate(zip(prompts, progress)):
            got = collect(iter(()), pr, len(p))
            assert_same_run((got, np.stack(pr.logits)), want[i], f"request {i}")
        assert pool.free_blocks == pool.num_blocks
        c.batcher.sched.check()


@pytest.mark.slow
def test_preempting_a_later_sequence_of_the_same_step(tiny_llama):
    """A step's sequences take blocks oldest first; when the pool runs out, the youngest one of
    the same step may be preempted for an older one before its own turn comes (it then waits,
    and its outputs are unchanged): 17 blocks of 4 tokens, a 7-token prompt generating 20
    tokens beside a 60-token prompt."""
    a, b = list(range(5, 12)), [(11 * j) % 200 + 5 for j in range(60)]
    pa, pb = (SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=4, ignore_eos=True))
    cfg = _cfg(tiny_llama, 1, max_context=68, max_seqs=2, kv_block=4, kv_blocks=17,
               prefix_cache=False)
    with Coordinator(cfg) as c:
        want = [c.generate(a, pa).tokens, c.generate(b, pb).tokens]
        progress = [Progress(), Progress()]
        reqs = [c.submit(a, pa, progress[0]), c.submit(b, pb, progress[1])]
        drive(c, reqs)
        assert [p.generated for p in progress] == want
        assert c.batcher.stats.preemptions >= 1
        assert c.batcher.sched.free_blocks == 17
        c.batcher.sched.check()


@pytest.mark.slow
def test_prompt_logprobs_count_every_row_once(tiny_llama, ref):
    """A prompt-logprobs request computes its whole prompt: it takes no live sequence's blocks
    (they would skip the rows whose logprobs it asks for), and when it is preempted before its
    first token its prompt's logprobs start again, not twice."""
    from layersplit.runtime.decoding import Decoding

    text = ref.tokenizer.encode("one shared system prompt for every agent of the team, " * 12)
    dec = Decoding(prompt_logprobs=1)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    with Coordinator(_cfg(tiny_llama, 1, max_seqs=2, kv_block=4, kv_blocks=24,
                          max_context=80, prefix_cache=False)) as c:
        alone = Progress()
        drive(c, [c.submit(text[:44], one, alone, decoding=dec)])
        assert len(alone.prompt_logprobs) == 43
        # live prefix: an older sequence has prefilled the same 36 first tokens
        older, shared = Progress(), Progress()
        first = c.submit(text[:40], SamplingParams(max_tokens=6, ignore_eos=True), older)
        while not older.generated:
            c.batcher.run_once()
        second = c.submit(text[:44], one, shared, decoding=dec)
        drive(c, [first, second])
        assert c.batcher.stats.shared_tokens == 0
        assert shared.prompt_logprobs == alone.prompt_logprobs
        # preempted between prefill chunks, before its first token: it runs again from row 0
        again = Progress()
        req = c.submit(text[:44], one, again, decoding=dec)
        while not (again.prompt_logprobs and req.in_flight == 0):
            assert not again.generated, "no point between two prefill chunks was seen"
            c.batcher.run_once()
        c.batcher._preempt(req)
        drive(c, [req])
        assert req.preempted == 1
        assert again.prompt_logprobs == alone.prompt_logprobs
        assert c.batcher.sched.free_blocks == 24


@pytest.mark.slow
def test_a_disk_restore_ended_before_its_first_token_queues_no_ram_copy(tiny_llama, ref,
                                                                         prompts, tmp_path):
    """Rows restored from disk are copied to RAM after the sequence's first token; a sequence
    cancelled before it leaves no copy queued for its slot (the slot's next sequence would
    otherwise file its own rows under the entry: one that takes a live prefix restores nothing
    and so clears nothing)."""
    longer = list(prompts[0]) + list(prompts[1][:9])
    want = run_logged(ref, longer, GREEDY)
    cfg = _cfg(tiny_llama, 2, kv_cache_dir=str(tmp_path), max_seqs=2)
    with Coordinator(cfg) as c:
        c.generate(list(prompts[0]), GREEDY)
    with Coordinator(cfg) as c:  # a restart: the 37 rows are on disk only
        progress = Progress()
        req = c.submit(longer, GREEDY, progress)
        c.batcher._admit()  # (restored; its prefill is the step it asks for next)
        assert [d[1] for d in c.cache.deferred_takes] == [req.slot]
        assert not progress.generated and progress.cache_tier == "disk"
        c.batcher.cancel(req)
        drive(c, [req])
        assert c.cache.deferred_takes == []
        assert_same_run(run_logged(c, longer, GREEDY), want, "after the cancel")
