"""Resident prefixes (`runtime.resident_kv`): a cached prefix whose KV blocks are still in the
device pool is served from them, with no snap_restore, and the output equals a cold run's
(invariant 3: tokens, and float32 logits bit for bit), with 1 and 2 shards; a small pool drops
held prefixes before it fails or preempts anyone, outputs unchanged; hybrid models restore
from RAM as before."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_logged, shard_children

CHUNK = 16
GREEDY = SamplingParams(max_tokens=9, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def _cfg(model, n: int, **kw) -> RuntimeConfig:
    kw = {"max_context": 256, "kv_block": 8, **kw}
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         threads=1, **kw)


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=256)


def _count_ram_restores(c: Coordinator) -> list[int]:
    """Entries each snap_restore of the shards' KV carried (a RAM restore), as they happen."""
    runs: list[int] = []
    inner = c.cache._restore_ram

    def counted(run, slot, context):
        if run:
            runs.append(len(run))
        return inner(run, slot, context)

    c.cache._restore_ram = counted
    return runs


def _turns(ref, eos: int) -> list[list[int]]:
    """Three user messages, each closed by the end-of-turn token (a chunk boundary off the
    block grid: the served prefix ends inside a block, whose rows are copied)."""
    enc = ref.tokenizer.encode
    return [enc("the quick brown fox jumps over the lazy dog and more") + [eos],
            enc(" then it ran far away") + [eos],
            enc(" and it came back home at night to sleep") + [eos]]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_conversation_turns_are_served_from_resident_blocks(tiny_llama, ref, n):
    with Coordinator(_cfg(tiny_llama, n)) as c:
        restores = _count_ram_restores(c)
        turns = _turns(ref, c.eos_ids[0])
        prompt: list[int] = []
        asked = 0  # the previous turn's prompt
        for k, message in enumerate(turns):
            prompt = prompt + message
            params = GREEDY if k % 2 == 0 else SAMPLED
            want = run_logged(ref, prompt, params)
            hits = c.cache.stats.hits_resident
            got = run_logged(c, prompt, params)
            assert_same_run(got, want, f"turn {k}")
            if k:  # the previous turn's prompt, up to its end of turn, is still in the pool
                assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", asked)
                assert c.cache.stats.hits_resident == hits + 1
            asked = len(prompt)
            prompt = prompt + got[0].tokens
        # an exact repeat: the whole prompt, its last block partly filled, and its logits
        last = prompt[:len(prompt) - len(got[0].tokens)]
        assert len(last) % c.config.kv_block
        got = run_logged(c, last, SAMPLED)
        assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", len(last))
        assert_same_run(got, run_logged(ref, last, SAMPLED), "exact repeat")
        assert restores == [], "a prefix still in the pool was copied in from RAM"
        assert c.cache.stats.hits_resident == len(turns)
        assert c.cache.stats.tokens_resident > 0
        sched = c.batcher.sched
        sched.check()
        assert sched.resident.held and sched.reclaimable_blocks == sched.total_blocks
    assert shard_children() == []


@pytest.mark.slow
def test_a_small_pool_drops_resident_prefixes_first(tiny_llama, ref):
    """18 blocks of 8 rows: the prefixes the first prompts leave held fill most of the pool; a
    long prompt then needs their blocks, which are dropped (least recently used first) before
    anything is preempted or fails, all but the one it starts with (it shares that one's blocks
    from admission on); outputs unchanged, and a dropped prefix restores from RAM."""
    enc = ref.tokenizer.encode
    text = enc("a long agentic conversation about many things, " * 12)
    prompts = [text[11 * i:11 * i + 40] for i in range(3)]
    long = text[:130]
    want = {id(p): run_logged(ref, p, GREEDY) for p in (*prompts, long)}
    with Coordinator(_cfg(tiny_llama, 2, max_context=144, max_seqs=2, kv_blocks=18)) as c:
        sched = c.batcher.sched
        for p in prompts:
            assert_same_run(run_logged(c, p, GREEDY), want[id(p)], "cold")
        assert len(sched.resident.held) >= 3 and sched.free_blocks < 18
        hits = c.cache.stats.hits_resident
        got = run_logged(c, long, GREEDY)
        assert_same_run(got, want[id(long)], "long")
        assert sched.resident.evicted >= 2 and c.batcher.stats.preemptions == 0
        assert got[0].cached_tokens == 2 * CHUNK and c.cache.stats.hits_resident == hits + 1
        sched.check()
        restores = _count_ram_restores(c)
        hits = c.cache.stats.hits_resident
        got = run_logged(c, prompts[1], GREEDY)  # (dropped: its RAM copy restores it)
        assert_same_run(got, want[id(prompts[1])], "after eviction")
        assert got[0].cache_tier == "ram" and got[0].cached_tokens == len(prompts[1])
        assert restores and c.cache.stats.hits_resident == hits
        sched.check()
        assert sched.reclaimable_blocks == sched.total_blocks


@pytest.mark.slow
def test_hybrid_models_restore_from_ram(hybrid_models):
    model = hybrid_models["qwen3_5"]
    ref = ReferenceEngine(model, prefill_chunk=CHUNK, max_context=256)
    prompt = ref.tokenizer.encode("<|im_start|>user\nthe cat sat on the mat<|im_end|>\n" * 2)
    cold = ref.generate(prompt, GREEDY).tokens
    with Coordinator(_cfg(model, 1, kv_block=16)) as c:
        assert c.cache.sched is None
        restores = _count_ram_restores(c)
        assert c.generate(prompt, GREEDY).tokens == cold
        r = c.generate(prompt, GREEDY)
        assert r.cache_tier == "ram" and r.tokens == cold
        assert restores and c.cache.stats.hits_resident == 0
        assert not c.batcher.sched.resident.held


def test_held_blocks_are_shared_copied_and_dropped_for_room():
    """Bookkeeping alone: a slot's first blocks held under a key outlive its sequence; a new
    sequence takes them (the partial last block copied with its first step); they are dropped,
    least recently used first, when an admission needs their room."""
    from layersplit.runtime.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(slots=2, slot_tokens=64, block_tokens=8, micro_batches=1,
                                  step_tokens=64, num_blocks=8))
    s.submit("a", 20)
    [(_, slot)] = s.admit()
    table = s.pool.table(slot)
    assert s.resident.hold("k", slot, 20) and s.resident.rows("k") == 20
    s.release("a")
    s.check()
    assert s.free_blocks == 5 and s.reclaimable_blocks == 8
    s.submit("b", 30)
    [(_, slot)] = s.admit()
    assert s.share_resident(slot, "k", 20)
    assert s.pool.table(slot)[:2] == table[:2] and s.pool.table(slot)[2] != table[2]
    assert s.table_update(slot) == {"at": 0, "ids": s.pool.table(slot)}
    assert s.copy_update(slot) == [[table[2], s.pool.table(slot)[2]]]
    assert not s.share_resident(slot, "k", 20)  # (a slot's first message went out)
    s.copied(slot)
    s.check()
    s.release("b")
    s.submit("c", 64)  # the whole pool: the held prefix goes
    [(_, slot)] = s.admit()
    assert not s.resident.held and s.resident.evicted == 1 and s.free_blocks == 0
    s.check()


@pytest.mark.parametrize("seed", range(4))
def test_random_holds_shares_and_drops_keep_the_pool_whole(seed):
    """Admissions, grows, holds, shares and releases in a random order on a small pool: the
    pool's reference counts (and the count of blocks only held prefixes reference) stay exact,
    and once every sequence ends and every prefix is dropped, every block is free."""
    import random

    from layersplit.runtime.scheduler import PoolFull, Scheduler, SchedulerConfig

    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(slots=3, slot_tokens=40, block_tokens=4, micro_batches=1,
                                  step_tokens=64, num_blocks=16))
    rows: dict[int, int] = {}  # rid -> rows its table covers
    fresh: set[int] = set()  # admitted, no message for their slot yet

    def hint(rid, tokens):  # (the prefix a request would be served from: any held one)
        key = f"k{rng.randrange(6)}"
        held = s.resident.rows(key)
        return None if held is None else (key, min(held, tokens, rng.randrange(1, 41)))

    s.resident_for = hint
    for i in range(400):
        op = rng.random()
        if op < 0.25:
            s.submit(i, rng.randrange(1, 30))
            for rid, slot in s.admit():
                rows[rid] = rng.randrange(1, 30)
                s.grow(rid, rows[rid]) if s.can_grow(rid, rows[rid]) else None
                fresh.add(rid)
        elif op < 0.45 and fresh:
            rid = rng.choice(sorted(fresh))
            slot = s.running[rid].slot
            key = f"k{rng.randrange(6)}"
            held = s.resident.rows(key)
            pre = s.pre_shared.get(slot)
            if pre is not None and rng.random() < 0.5:
                s.unshare(slot)  # (its restore cannot serve what it shared at admission)
            elif pre is not None:
                assert s.share_resident(slot, *pre)
                s.table_update(slot)
            elif held is not None and held <= s.running[rid].blocks * 4 and \
                    s.share_resident(slot, key, held):
                s.table_update(slot)
                assert s.copy_update(slot) is not None or held % 4 == 0
            fresh.discard(rid)
        elif op < 0.65 and s.running:
            rid = rng.choice(sorted(s.running))
            have = s.running[rid].blocks * 4
            if have:
                s.resident.hold(f"k{rng.randrange(6)}", s.running[rid].slot,
                                rng.randrange(1, have + 1))
        elif op < 0.8 and s.running:
            rid = rng.choice(sorted(s.running))
            try:
                s.grow(rid, min(40, s.running[rid].blocks * 4 + rng.randrange(1, 9)))
            except PoolFull:
                pass
            s.copied(s.running[rid].slot)
            fresh.discard(rid)
        elif s.running:
            rid = rng.choice(sorted(s.running))
            s.release(rid)
            fresh.discard(rid)
        s.check()
    for rid in list(s.running):
        s.release(rid)
    s.check()
    assert s.reclaimable_blocks == s.total_blocks
    s.resident.clear()
    s.check()
    assert s.free_blocks == s.total_blocks and s.pool.kept_only == 0


def test_held_prefixes_stay_when_dropping_them_cannot_make_the_room():
    """An admission (or a step's growth) the pool cannot take even with every held prefix
    dropped leaves them held: dropping them would free blocks nobody gets (a large request
    waiting at the head of the queue would otherwise drop every prefix held, each loop)."""
    from layersplit.runtime.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(slots=3, slot_tokens=32, block_tokens=4, micro_batches=1,
                                  step_tokens=64, num_blocks=8))
    s.submit("a", 12)
    [(_, slot)] = s.admit()
    assert s.resident.hold("k", slot, 12)
    s.release("a")
    s.submit("b", 20)
    assert [rid for rid, _ in s.admit()] == ["b"]
    assert s.free_blocks == 0 and s.reclaimable_blocks == 3
    s.submit("c", 16)  # 4 blocks: more than the 3 the held prefix could give back
    assert s.admit() == []
    assert s.resident.rows("k") == 12 and s.resident.evicted == 0
    assert not s.can_grow("b", 36)  # (4 blocks more than b's 5: no room either way)
    assert s.resident.rows("k") == 12 and s.resident.evicted == 0
    s.check()
    assert s.can_grow("b", 28)  # (2 more: the held prefix's blocks make the room)
    assert s.resident.rows("k") is None and s.resident.evicted == 1
    s.check()


@pytest.mark.slow
def test_a_conversation_longer_than_half_the_pool_is_served_resident(tiny_llama, ref):
    """17 blocks of 8 rows: the first turn's prompt (9 blocks) stays held; the next turn's
    prompt (12 blocks) fits the pool beside the 9 full blocks it would share, but not beside
    a copy of them."""
    enc = ref.tokenizer.encode
    text = enc("a long agentic conversation about many things, " * 12)
    first, second = text[:70], text[:92]
    with Coordinator(_cfg(tiny_llama, 1, max_context=136, max_seqs=1, kv_blocks=17)) as c:
        assert_same_run(run_logged(c, first, GREEDY), run_logged(ref, first, GREEDY), "cold")
        assert c.batcher.sched.resident.rows(c.cache.keys(first, [len(first)])[len(first)])
        got = run_logged(c, second, GREEDY)
        assert_same_run(got, run_logged(ref, second, GREEDY), "second")
        assert got[0].cached_tokens >= 64 and c.cache.stats.hits_resident == 1


def test_admission_shares_the_prefix_it_would_be_served_from():
    """Bookkeeping alone: 17 blocks of 8 rows, 9 holding a prefix of 70 rows; a prompt of 92
    rows (12 blocks) that the first 68 serve is admitted beside that prefix's 8 full blocks
    (the partial one copied), none dropped; its restore takes them as they are. One that
    cannot (its entry left RAM) gets blocks of its own (the prefix dropped for them)."""
    from types import SimpleNamespace

    from layersplit.runtime.resident_kv import settle
    from layersplit.runtime.scheduler import Scheduler, SchedulerConfig

    def fresh():
        s = Scheduler(SchedulerConfig(slots=1, slot_tokens=136, block_tokens=8,
                                      micro_batches=1, step_tokens=64, num_blocks=17))
        s.submit("a", 70)
        [(_, slot)] = s.admit()
        assert s.resident.hold("k", slot, 70)
        held = s.pool.table(slot)
        s.release("a")
        s.resident_for = lambda rid, n: ("k", 68) if n == 92 else None
        s.submit("b", 92)
        [(_, slot)] = s.admit()
        assert s.resident.rows("k") == 70 and s.resident.evicted == 0 and s.free_blocks == 4
        assert s.pool.table(slot)[:8] == held[:8] and s.pool.table(slot)[8] != held[8]
        assert s.pre_shared == {slot: ("k", 68)}
        s.check()
        return s, slot, held

    def entry(key, length, in_ram=True):
        return SimpleNamespace(key=key, length=length, in_ram=in_ram, logits=None)

    s, slot, held = fresh()
    chain = [entry("j", 64), entry("k", 68)]
    assert settle(s, slot, chain, 92) == chain and s.pre_shared
    with pytest.raises(ValueError, match="since admission"):
        s.share_resident(slot, "j", 64)
    assert s.share_resident(slot, "k", 68) and not s.pre_shared
    assert s.copy_update(slot) == [[held[8], s.pool.table(slot)[8]]]
    s.check()

    s, slot, held = fresh()
    chain = [entry("j", 64), entry("k", 68, in_ram=False)]
    assert settle(s, slot, chain, 92) == chain  # (the prefix dropped: 12 blocks of its own)
    assert not s.pre_shared and s.resident.evicted == 1 and s.running["b"].blocks == 12
    assert s.copy_update(slot) is None and all(s.pool.refs[b] == 1 for b in s.pool.table(slot))
    s.check()
