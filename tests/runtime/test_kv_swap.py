"""Swap preemption (the host-memory tier of live KV): when the paged KV pool runs out
mid-decode, the youngest sequence's blocks go to every shard's host KV pool and come back when
it is admitted again; it resumes where it stopped, without computing a row twice.

- a pool that runs out mid-decode swaps the youngest sequence out and back in: tokens and
  logits equal an uninterrupted run bit for bit, no row is computed twice, and every device
  and host block is free at the end (1 and 2 shards, shm and zmq); a sequence cancelled while
  swapped out frees its slot and host blocks;
- a sequence holding a live prefix's shared blocks, or whose blocks another one shares, is
  swapped out and back without touching the other's;
- a host pool too small for the sequence (or none) falls back to re-prefill: the same tokens;
  so does a sequence that feeds the draft process, while the plain ones beside it swap;
- bad `kv_swap` messages are refused by name, and the runtime goes on serving;
- the scheduler's swapped state (pure bookkeeping) and bad kv_host_* settings;
- with `host_cache_gb` swapped-out sequences and the RAM tier share each shard's host memory:
  a swap-out evicts the least recently used snapshots, the output stays an uninterrupted
  run's, and the evicted prefix asked again is a miss with the same tokens; a sequence that
  ends while swapped out gives its host memory back on the shards too.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from layersplit.ipc.messages import message
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Progress, collect
from layersplit.runtime.scheduler import Scheduler, SchedulerConfig
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, drive, run_logged

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(20)] for i in range(3)]
PARAMS = [GREEDY, SAMPLED, GREEDY]


def _cfg(model, n: int, **kw) -> RuntimeConfig:
    # (no decode lookahead: these tests drive the batch by hand to a moment where a sequence
    # mid-generation has no step in flight, which lookahead keeps from coming; swaps under
    # lookahead: tests/runtime/test_decode_ahead.py)
    kw = {"max_context": 128, "prefill_chunk": 12, "kv_block": 16, "prefix_cache": False,
          "decode_ahead": False, **kw}
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, threads=1, **kw)


@pytest.fixture(scope="module")
def alone(target):
    """Each prompt alone, in a pool that never runs out: tokens and logits."""
    with Coordinator(_cfg(target, 1, max_seqs=1, kv_blocks=8)) as c:
        return [run_logged(c, p, params) for p, params in zip(PROMPTS, PARAMS)]


def _batch(c: Coordinator) -> list:
    progress = [Progress(logits=[]) for _ in PROMPTS]
    got = c.generate_batch(PROMPTS, PARAMS, progress=progress)
    return [(r, np.stack(pr.logits)) for r, pr in zip(got, progress)]


def _all_free(c: Coordinator) -> None:
    b = c.batcher
    assert b.sched.reclaimable_blocks == b.sched.total_blocks and not b.sched.running
    assert not b.sched.swapped and not b.sched.waiting
    if b.host is not None:
        assert b.host.free_blocks == b.host.num_blocks and b.stats.host_blocks == 0
    assert not c.host_pool.swapped and c.host_pool.swapped_bytes() == (0,) * len(c.shards)
    b.check()


@pytest.mark.slow
@pytest.mark.parametrize("n,transport,cache", [(1, "auto", False), (2, "shm", True),
                                               (2, "zmq", False)])
def test_pool_exhaustion_swaps_out_and_back(target, alone, n, transport, cache):
    """6 blocks of 16 tokens (96 rows) for three sequences of 20-token prompts generating 24
    tokens each (44 rows, 3 blocks each): the pool runs out mid-decode, the youngest is swapped
    out (2 blocks to the host pool) and back; every output equals the prompt's alone, logits
    bit for bit, and the rows computed are those of uninterrupted runs (no re-prefill; with the
    prefix cache on, its snapshots of the distinct prompts restore nothing)."""
    cfg = _cfg(target, n, max_seqs=3, kv_blocks=6, kv_host_blocks=4, transport=(transport,),
               prefix_cache=cache)
    with Coordinator(cfg) as c:
        assert [s["kv_host_blocks"] for s in c.shard_info()] == [4] * n
        got = _batch(c)
        for i, (g, w) in enumerate(zip(got, alone)):
            assert_same_run(g, w, f"sequence {i}")
        st = c.batcher.stats
        assert st.swapped_out >= 1 and st.swapped_in == st.swapped_out
        assert st.reprefills == 0 and st.preemptions == st.swapped_out
        assert st.rows == sum(len(p) + params.max_tokens - 1
                              for p, params in zip(PROMPTS, PARAMS))
        _all_free(c)


@pytest.mark.slow
def test_a_sequence_cancelled_while_swapped_out_frees_everything(target, alone):
    """A sequence swapped out by hand and cancelled before it comes back gives back its slot
    and host blocks; one swapped out by hand and resumed yields an uninterrupted run's output."""
    with Coordinator(_cfg(target, 2, max_seqs=2, kv_blocks=8, kv_host_blocks=4)) as c:
        b = c.batcher
        progress = [Progress(logits=[]), Progress(logits=[])]
        reqs = [c.submit(p, params, pr) for p, params, pr in
                zip(PROMPTS[:2], PARAMS[:2], progress)]
        while not (len(progress[1].generated) >= 3 and reqs[1].in_flight == 0
                   and reqs[1].waits is None):
            b.run_once()
        b._preempt(reqs[1])
        assert reqs[1].swapped is not None and b.stats.host_blocks == 2
        assert reqs[1].slot in {r.slot for r in b.sched.swapped.values()}
        held = b.host.table(reqs[1].rid)
        b.check()
        b.cancel(reqs[1])
        assert reqs[1].done and not b.sched.swapped and b.host.free_blocks == 4
        b.check()
        for sh in c.shards:  # its host blocks were given back on every shard too
            with pytest.raises(ShardFailure, match=f"host block {held[0]} holds nothing"):
                c._call(sh, message("kv_swap", direction="in", pairs=[[0, held[0]]]),
                        time.monotonic() + 30)
        while not reqs[0].done:
            b.run_once()
        assert_same_run((collect(iter(()), progress[0], 20), np.stack(progress[0].logits)),
                        alone[0], "the other sequence")
        _all_free(c)
        # swapped out by hand mid-decode and resumed: the same run as alone
        pr = Progress(logits=[])
        req = c.submit(PROMPTS[1], PARAMS[1], pr)
        while not (len(pr.generated) >= 5 and req.in_flight == 0 and req.waits is None):
            b.run_once()
        b._preempt(req)
        while not req.done:
            b.run_once()
        assert req.error is None and b.stats.swapped_in == 1
        assert_same_run((collect(iter(()), pr, 20), np.stack(pr.logits)), alone[1], "resumed")
        _all_free(c)


@pytest.mark.slow
def test_live_prefix_blocks_are_swapped_as_the_sequences_own(tiny_llama):
    """Two sequences on one 84-token prefix, the second holding the first's 5 full blocks by
    reference: swapping out either one copies all its blocks to the host pool and drops only
    its own references (the other keeps the shared blocks), and it comes back into blocks of
    its own; both outputs equal the prompts' alone, logits bit for bit."""
    from layersplit.runtime.reference import ReferenceEngine

    ref = ReferenceEngine(tiny_llama, prefill_chunk=12, max_context=512)
    text = ref.tokenizer.encode("one shared system prompt for every agent of the team, " * 12)
    prompts = [text[:84] + text[90:94], text[:84] + text[94:98]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [run_logged(ref, p, params) for p in prompts]
    with Coordinator(_cfg(tiny_llama, 2, max_seqs=2, max_context=256,
                          kv_host_blocks=16)) as c:
        b, pool = c.batcher, c.batcher.sched.pool
        for which in (0, 1):
            pr = [Progress(logits=[]), Progress(logits=[])]
            reqs = [c.submit(prompts[0], params, pr[0])]
            while not pr[0].generated:
                b.run_once()
            reqs.append(c.submit(prompts[1], params, pr[1]))
            r = reqs[which]
            while not (pr[1].generated and r.in_flight == 0 and r.waits is None):
                assert not r.done
                b.run_once()
            shared = pool.table(reqs[0].slot)[:5]
            assert b.stats.shared_tokens == 84 * (which + 1)
            assert [pool.refs[x] for x in shared] == [2] * 5
            b._preempt(r)
            assert r.swapped == r.pending.pos and b.stats.swapped_out == which + 1
            assert [pool.refs[x] for x in shared] == [1] * 5  # the other one's now
            b.check()
            while not all(q.done for q in reqs):
                b.run_once()
            for i, (p, q) in enumerate(zip(prompts, pr)):
                assert_same_run((collect(iter(()), q, len(p)), np.stack(q.logits)), want[i],
                                f"sequence {i}, sequence {which} swapped")
            assert b.stats.swapped_in == which + 1 and b.stats.reprefills == 0
            _all_free(c)


@pytest.mark.slow
@pytest.mark.parametrize("host", [1, 0])
def test_a_host_pool_too_small_falls_back_to_reprefill(target, alone, host):
    """A host pool of 1 block cannot take a 32-row sequence (2 blocks), and none at all
    swaps nothing: the youngest runs again from its tokens, with the same output tokens."""
    with Coordinator(_cfg(target, 2, max_seqs=3, kv_blocks=6, kv_host_blocks=host)) as c:
        assert (c.batcher.host is None) == (host == 0)
        got = _batch(c)
        assert [g[0].tokens for g in got] == [w[0].tokens for w in alone]
        st = c.batcher.stats
        assert st.swapped_out == 0 and st.reprefills >= 1
        _all_free(c)


@pytest.mark.slow
def test_a_sequence_that_feeds_the_draft_is_prefilled_again(target, dflash):
    """A sequence that feeds the draft process (and speculates) is not swapped (the draft's
    context is not in the blocks): preempted, it runs again from its tokens; the plain ones
    beside it are swapped; every output equals the prompt's alone."""
    cfg = _cfg(target, 2, max_seqs=3, kv_blocks=8, kv_host_blocks=6, draft=str(dflash),
               draft_device="cpu", spec_max_seqs=1)
    with Coordinator(cfg) as c:
        alone = [c.generate(p, params, use_cache=False).tokens
                 for p, params in zip(PROMPTS, PARAMS)]
        b = c.batcher
        progress = [Progress() for _ in PROMPTS]
        reqs = [c.submit(p, params, pr) for p, params, pr in zip(PROMPTS, PARAMS, progress)]
        while not (len(progress[0].generated) >= 2 and reqs[0].in_flight == 0
                   and reqs[0].waits is None):
            b.run_once()
        assert reqs[0].feed is not None and progress[0].spec is not None
        b._preempt(reqs[0])
        assert b.stats.reprefills == 1 and reqs[0].swapped is None and reqs[0].program is None
        while not (reqs[2].in_flight == 0 and reqs[2].waits is None and reqs[2].program):
            b.run_once()
        assert reqs[2].feed is None and progress[2].spec is None
        b._preempt(reqs[2])  # a plain one beside it
        assert reqs[2].swapped is not None and b.stats.swapped_out == 1
        while not all(r.done for r in reqs):
            b.run_once()
        assert [pr.generated for pr in progress] == alone
        st = b.stats
        assert st.swapped_out == st.swapped_in >= 1
        assert st.preemptions == st.swapped_out + st.reprefills
        _all_free(c)


@pytest.mark.slow
def test_bad_kv_swap_messages_are_refused_by_name(target):
    with Coordinator(_cfg(target, 2, max_seqs=2, kv_blocks=6, kv_host_blocks=3)) as c:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        want = c.generate(PROMPTS[0], params).tokens
        cases = [
            ("out", [[6, 0]], "kv_swap: pair [6, 0] outside device blocks 0..5 or host blocks "
                              "0..2"),
            ("in", [[0, 3]], "pair [0, 3] outside device blocks 0..5 or host blocks 0..2"),
            ("out", [[-1, 0]], "pair [-1, 0] outside"),
            ("out", [[0, 1], [0, 2]], "kv_swap: pairs list a device block twice"),
            ("in", [[0, 1], [2, 1]], "kv_swap: pairs list a host block twice"),
            ("out", [[0, 1, 2]], "kv_swap: pairs must be a list of [device block, host block]"),
            ("out", [[0, True]], "pairs must be a list of [device block, host block]"),
            ("out", [0, 1], "pairs must be a list of [device block, host block]"),
            ("out", "0,1", "kv_swap: field 'pairs' must be list, got str"),
            ("sideways", [[0, 0]], "kv_swap: direction 'sideways' must be 'out', 'in' or "
                                   "'drop'"),
            ("in", [[0, 0]], "kv_swap: host block 0 holds nothing"),
            ("drop", [[0, 0]], "kv_swap: drop pair [0, 0] is not [-1, host block 0..2]"),
            ("drop", [[-1, 1], [-1, 1]], "kv_swap: pairs list a host block twice"),
        ]
        for direction, pairs, why in cases:
            for sh in c.shards:
                with pytest.raises(ShardFailure, match=re.escape(why)):
                    c._call(sh, message("kv_swap", direction=direction, pairs=pairs),
                            time.monotonic() + 30)
            assert c.failed is None
        assert c.generate(PROMPTS[0], params).tokens == want  # nothing lost
    with Coordinator(_cfg(target, 1, max_seqs=2, kv_blocks=6, kv_host_blocks=0)) as c:
        with pytest.raises(ShardFailure, match=re.escape("kv_swap: this shard has no host KV "
                                                         "pool (kv_host_blocks 0)")):
            c._call(c.shards[0], message("kv_swap", direction="out", pairs=[]),
                    time.monotonic() + 30)
        assert c.generate(PROMPTS[0], params).tokens == want


@pytest.mark.parametrize("kw,match", [
    ({"kv_host_blocks": -1}, "kv_host_blocks=-1: must be >= 0"),
    ({"kv_host_gb": -0.5}, "kv_host_gb=-0.5: must be a finite number >= 0"),
    ({"kv_host_gb": float("nan")}, "kv_host_gb=nan: must be a finite number"),
    ({"kv_host_gb": float("inf")}, "kv_host_gb=inf: must be a finite number"),
    ({"kv_host_gb": 1.0, "kv_host_blocks": 8}, "set kv_host_blocks or kv_host_gb, not both"),
])
def test_bad_kv_host_settings_are_refused_by_name(kw, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        RuntimeConfig(**kw)


def test_kv_host_pool_sizes(tiny_llama):
    from layersplit.runtime.kv_pool import block_bytes, kv_host_pool_blocks
    from layersplit.runtime.placement import plan
    from layersplit.shards.checkpoint import open_checkpoint

    mc = open_checkpoint(tiny_llama, 0).config
    for kw, want in (({"kv_host_blocks": 7}, 7), ({"kv_host_blocks": 0}, 0), ({}, 25),
                     ({"kv_host_gb": 0.0}, 0)):
        cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), **kw)
        pl = plan(cfg, mc.num_layers, None)
        assert kv_host_pool_blocks(cfg, mc, pl, 4, 100) == want, kw
    per = max(block_bytes(mc, s.end - s.start, 16, 4) for s in pl.shards)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), kv_host_gb=1.0)
    assert kv_host_pool_blocks(cfg, mc, pl, 4, 100) == 2**30 // per
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), kv_host_gb=1e-9)
    with pytest.raises(ConfigError, match=re.escape("kv_host_gb=1e-09: less than one KV block")):
        kv_host_pool_blocks(cfg, mc, pl, 4, 100)


def test_scheduler_swapped_sequences_keep_their_slot():
    """swap_out frees the blocks and keeps the slot; the sequence is admitted again first, in
    the same slot, once the blocks of its next step are free; cancelling it frees the slot."""
    s = Scheduler(SchedulerConfig(slots=3, slot_tokens=64, block_tokens=4, micro_batches=1,
                                  step_tokens=64, num_blocks=10))
    s.submit("a", 12)
    s.submit("b", 16)
    assert s.admit() == [("a", 0), ("b", 1)]
    s.grow("b", 20)
    s.swap_out("b", 21)  # 6 blocks when it comes back
    assert s.free_blocks == 7 and "b" in s.swapped and s.waiting[0] == ("b", 21)
    s.check()
    s.submit("c", 4)
    s.grow("a", 28)  # 7 blocks: 3 free, too few for b
    assert s.admit() == []  # b first (FIFO): c waits behind it
    s.release("a")
    assert s.admit() == [("b", 1), ("c", 0)]
    assert s.running["b"].blocks == 6 and s.table_update(1) == {"at": 0,
                                                               "ids": s.pool.table(1)}
    s.check()
    s.swap_out("c", 4)
    with pytest.raises(ValueError, match="slot 0 is not free to drive by hand"):
        s.hold_slot(0, 4, new=True)
    assert s.cancel_waiting("c") and 0 in s.free_slots[0] and not s.swapped
    s.check()
    with pytest.raises(ValueError, match="exceed the KV pool"):
        s.swap_out("b", 44)


@pytest.mark.slow
def test_no_swap_while_the_shared_rows_are_still_written(target):
    """B takes 48 rows of A while A's prefill steps that write them are still in the chain: a
    swap (sent to every shard at once, ahead of those steps) would copy rows not written yet,
    so B is prefilled again instead; its tokens equal B's alone."""
    a = [(5 * j) % 190 + 5 for j in range(60)]
    b = a[:48] + [(11 * j) % 190 + 7 for j in range(8)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cfg = _cfg(target, 2, prefill_chunk=16, max_seqs=2, max_context=256, kv_host_blocks=16)
    with Coordinator(cfg) as c:
        want = c.generate(b, params, use_cache=False).tokens
        pa, pb = Progress(), Progress()
        ra = c.submit(a, params, pa)
        c.batcher._admit()
        c.batcher._send_ready()  # A's chunks, in the chain (none waited for)
        assert ra.in_flight >= 2
        rb = c.submit(b, params, pb)
        c.batcher._admit()
        assert rb.shared == 48 and not c.batcher.sched.copies.get(rb.slot)
        c.batcher._preempt(rb)
        assert rb.swapped is None and c.batcher.stats.reprefills == 1
        drive(c, [ra, rb])
        assert collect(iter(()), pb, len(b)).tokens == want
        _all_free(c)


@pytest.mark.slow
def test_a_block_copy_keeps_its_source(target):
    """T shares S's first 36 rows: two full blocks and a copy of S's third, made with T's first
    step. S swapped out meanwhile (and back in at once) must not free that block before the
    copy is made: T's tokens equal T's alone."""
    s = [(5 * j) % 190 + 5 for j in range(60)]
    t = s[:40] + [(11 * j) % 190 + 7 for j in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cfg = _cfg(target, 2, max_seqs=2, max_context=256, kv_host_blocks=16)
    with Coordinator(cfg) as c:
        want = c.generate(t, params, use_cache=False).tokens
        b, pool = c.batcher, c.batcher.sched.pool
        ps, pt = Progress(), Progress()
        rs = c.submit(s, params, ps)
        while not (len(ps.generated) >= 2 and rs.in_flight == 0 and rs.waits is None):
            b.run_once()
        rt = c.submit(t, params, pt)
        b._admit()
        (src, _), = b.sched.copies[rt.slot]
        b._preempt(rs)
        assert rs.swapped is not None and src not in pool.free_ids  # (held for the copy)
        b._admit()  # S comes back first, into free blocks
        b.sched.check()
        drive(c, [rs, rt])
        assert collect(iter(()), pt, len(t)).tokens == want
        _all_free(c)


@pytest.mark.slow
def test_two_micro_batches_and_a_swapped_sequence(target, tmp_path):
    """With 2 micro-batches a sequence swapped out while one group's step is planned is not
    sent with the other group's (it waits to be admitted again): every output equals its
    prompt's alone. (The prefix cache's operations let both groups' steps come back at once.)"""
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(20 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with Coordinator(_cfg(target, 2, max_seqs=1, kv_blocks=8, prefill_chunk=16)) as c:
        want = [c.generate(p, params, use_cache=False).tokens for p in prompts]
    for seqs, blocks in ((4, 8), (6, 10)):  # (the second run restores what the first saved)
        cfg = _cfg(target, 2, max_seqs=seqs, micro_batches=2, kv_blocks=blocks,
                   prefill_chunk=16, kv_host_blocks=16, prefix_cache=True,
                   kv_cache_dir=str(tmp_path))
        with Coordinator(cfg) as c:
            got = c.generate_batch(prompts, [params] * len(prompts))
            assert [r.tokens for r in got] == want
            assert c.batcher.stats.swapped_out >= 1
            _all_free(c)


def _alone(c: Coordinator, prompt: list[int], params: SamplingParams) -> tuple:
    """The prompt run without the prefix cache (nothing restored, nothing snapshotted)."""
    progress = Progress(logits=[])
    got = collect(c.stream(prompt, params, progress, use_cache=False), progress, len(prompt))
    return got, np.stack(progress.logits)


@pytest.mark.slow
@pytest.mark.parametrize("disk", [False, True])
def test_a_swap_out_evicts_the_least_recently_used_snapshots(target, tmp_path, disk):
    """host_cache_gb = 54 rows of KV per shard, for swapped-out sequences and RAM-tier snapshots
    together. P0's snapshots (rows 0:12 and 12:20) and P1's fill 40 rows; swapping P1 out
    mid-decode (2 blocks, 32 rows) evicts P0's two (the least recently used, leaf first) and
    keeps P1's. P1's output equals an uninterrupted run's, logits bit for bit; P0 asked again
    is a miss (a disk hit, with a disk tier) with its first run's tokens and logits; host
    memory is back to the snapshots."""
    from layersplit.runtime.kv_pool import block_bytes
    from layersplit.shards.checkpoint import open_checkpoint

    mc = open_checkpoint(target, 0).config
    assert mc.num_layers == 6
    row = block_bytes(mc, 3, 1, 4)  # bytes of one KV row on either shard (3 layers, float32)
    cfg = _cfg(target, 2, max_seqs=2, kv_blocks=8, prefix_cache=True,
               host_cache_gb=54 * row / 2**30, kv_cache_dir=str(tmp_path) if disk else None)
    p0, p1 = PROMPTS[0], PROMPTS[1]
    with Coordinator(cfg) as c:
        b, pool, index = c.batcher, c.host_pool, c.cache.index
        assert pool.capacity == (54 * row,) * 2 and b.host.num_blocks == 3
        want0, want1 = _alone(c, p0, GREEDY), _alone(c, p1, SAMPLED)
        assert not index.entries and pool.used == [0, 0]
        first0 = run_logged(c, p0, GREEDY)
        assert_same_run(first0, want0, "P0 with the cache")
        c._finish_saves(30)  # (an entry being saved is not evicted)
        old = {e.key for e in index.entries.values() if e.in_ram}
        assert len(old) == 2 and pool.used == [20 * row] * 2
        pr = Progress(logits=[])
        req = c.submit(p1, SAMPLED, pr)
        while not (len(pr.generated) >= 5 and req.in_flight == 0 and req.waits is None):
            b.run_once()
        new = {e.key for e in index.entries.values() if e.in_ram} - old
        assert len(new) == 2 and pool.used == [40 * row] * 2
        b._preempt(req)
        assert req.swapped is not None and b.stats.swapped_out == 1 and b.stats.reprefills == 0
        assert {e.key for e in index.entries.values() if e.in_ram} == new
        assert set(index.entries) == (new | old if disk else new)
        assert c.cache.stats.evicted_ram == 2
        assert pool.used == [(20 + 32) * row] * 2 and pool.swapped == {req.rid: (32 * row,) * 2}
        b.check()
        drive(c, [req])
        assert b.stats.swapped_in == 1
        assert_same_run((collect(iter(()), pr, len(p1)), np.stack(pr.logits)), want1,
                        "P1 swapped out and back")
        assert pool.used == [20 * row] * 2
        misses, hits = c.cache.stats.misses, c.cache.stats.hits_disk
        again = run_logged(c, p0, GREEDY)
        if disk:
            assert again[0].cache_tier == "disk" and c.cache.stats.hits_disk == hits + 1
        else:
            assert again[0].cache_tier == "none" and c.cache.stats.misses == misses + 1
        assert_same_run(again, want0, "P0 after its snapshots were evicted")
        assert pool.used == [40 * row] * 2  # (P0's RAM copies taken again)
        _all_free(c)


@pytest.mark.slow
def test_deferred_snapshots_are_dropped_once_the_rows_are_swapped_out(target, alone):
    """A prompt's snapshots wait for its first decode step to come back. Swapped out before
    that (its blocks freed), the sequence takes none of them: cancelled while swapped out, it
    leaves no entry; swapped out and its swap-in failing (its host blocks gone), it is
    prefilled again, and no entry holds its first prompt whole (the rows its slot's new
    blocks held then were not its own), and it yields an uninterrupted run's tokens."""
    with Coordinator(_cfg(target, 1, max_seqs=2, kv_blocks=8, kv_host_blocks=4,
                          prefix_cache=True)) as c:
        b, index = c.batcher, c.cache.index

        def first_token_out(params: SamplingParams, pr: Progress):
            req = c.submit(PROMPTS[1], params, pr)
            while not (pr.generated and req.in_flight == 0 and req.waits is None):
                b.run_once()
            assert not index.entries  # (deferred: no decode step came back yet)
            b._preempt(req)
            assert req.swapped is not None and req.rows_gone
            return req

        req = first_token_out(GREEDY, Progress())
        b.cancel(req)
        assert req.done and not index.entries
        b.check()
        pr = Progress()
        req = first_token_out(PARAMS[1], pr)
        c.kv_swap("drop", [[-1, h] for h in b.host.table(req.rid)])  # (the swap-in fails)
        drive(c, [req])
        assert b.stats.reprefills == 1 and b.stats.swapped_in == 0
        assert len(PROMPTS[1]) not in {e.length for e in index.entries.values()}
        assert pr.generated == alone[1][0].tokens  # (a re-prefill: the same tokens)
        # (its time to the first token is its first run's, phase by phase)
        assert pr.marks["admitted"] <= pr.marks["restored"] <= pr.first_token_at
        _all_free(c)
