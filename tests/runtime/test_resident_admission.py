"""A resident prefix shared at admission (`runtime.resident_kv.admission_hint`,
`Scheduler._take_shared`) that its restore cannot serve any more (its entry left the RAM tier
between admission and restore) is given up for blocks of the slot's own (`settle`): outputs
equal a cold run's and the pool's counts stay exact, also where the pool cannot give the slot
all its blocks back at once (a live sequence still references the prefix's blocks)."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.generate import Progress, collect
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, drive, run_logged

CHUNK = 16
GREEDY = SamplingParams(max_tokens=9, ignore_eos=True)


def _cfg(model, **kw) -> RuntimeConfig:
    kw = {"max_context": 136, "kv_block": 8, "kv_blocks": 17, **kw}
    return RuntimeConfig(model=str(model), devices=("cpu",), prefill_chunk=CHUNK, threads=1,
                         **kw)


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=256)


def _evict_before_restore(c: Coordinator) -> list[tuple[str, int]]:
    """Before each restore into a slot that shares a prefix since admission: that prefix's
    entry leaves the RAM tier (as an eviction for another entry's room would make it); returns
    the (key, rows) so given up, as they happen."""
    sched, cache, inner = c.batcher.sched, c.cache, c.cache.restore
    gone: list[tuple[str, int]] = []

    def restore(prompt, cuts, slot, context):
        pre = sched.pre_shared.get(slot)
        if pre is not None:
            e = cache.index.entries[pre[0]]
            ram_id, e.ram_id = e.ram_id, None
            if e.path is None:
                del cache.index.entries[e.key]
            cache._drop_ram([ram_id])
            gone.append(pre)
        return inner(prompt, cuts, slot, context)

    cache.restore = restore
    return gone


@pytest.mark.slow
def test_a_prefix_shared_at_admission_that_left_ram_is_given_up(tiny_llama, ref):
    """17 blocks of 8 rows: the first turn (70 rows) stays held; the next (92 rows, 12 blocks)
    is admitted sharing its first 8 blocks; its entry then leaves RAM: the slot gets 12 blocks
    of its own (the held prefix dropped for them) and prefills the whole prompt."""
    enc = ref.tokenizer.encode
    text = enc("a long agentic conversation about many things, " * 12)
    first, second = text[:70], text[:92]
    with Coordinator(_cfg(tiny_llama, max_seqs=1)) as c:
        sched = c.batcher.sched
        assert_same_run(run_logged(c, first, GREEDY), run_logged(ref, first, GREEDY), "cold")
        gone = _evict_before_restore(c)
        got = run_logged(c, second, GREEDY)
        assert gone and gone[0][1] == 64
        assert_same_run(got, run_logged(ref, second, GREEDY), "second")
        assert got[0].cached_tokens == 0 and c.cache.stats.hits_resident == 0
        assert not sched.pre_shared
        sched.check()
        assert_same_run(run_logged(c, second, GREEDY), run_logged(ref, second, GREEDY),
                        "again")
        sched.check()
        assert sched.reclaimable_blocks == sched.total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("disk", [False, True])
def test_a_given_up_prefix_the_pool_cannot_replace_at_once(tiny_llama, ref, tmp_path, disk):
    """The first turn still decodes (its table references the held prefix's blocks) when the
    next is admitted sharing them; the entry then leaves RAM: dropping held prefixes frees
    none of those blocks, so the slot gets fewer than its prompt's blocks and its prefill
    steps grow it. Both outputs equal their cold runs'; the pool stays whole. With a disk
    tier the entry is then restored from its file, into the blocks the slot has."""
    enc = ref.tokenizer.encode
    text = enc("a long agentic conversation about many things, " * 12)
    first, second = text[:70], text[:92]
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = {"kv_cache_dir": str(tmp_path)} if disk else {}
    with Coordinator(_cfg(tiny_llama, max_seqs=2, **kw)) as c:
        b, sched = c.batcher, c.batcher.sched
        key = c.cache.keys(first, [64])[64]
        gone = _evict_before_restore(c)
        pa, pb = Progress(), Progress()
        ra = c.submit(first, long, pa)
        while sched.resident.rows(key) is None or len(pa.generated) < 2 or \
                (disk and c.cache.index.entries[key].path is None):
            b.run_once()
            c.cache.saves.poll_done()
            assert not ra.done
        assert sched.free_blocks < 12
        rb = c.submit(second, GREEDY, pb)
        b._admit()
        assert gone == [(key, 64)], "not admitted sharing the prefix"
        assert 0 < sched.running[rb.rid].blocks < 12, "the pool gave all the blocks back"
        sched.check()
        drive(c, [ra, rb])
        assert collect(iter(()), pa, len(first)).tokens == ref.generate(first, long).tokens
        assert collect(iter(()), pb, len(second)).tokens == ref.generate(second, GREEDY).tokens
        assert pb.cache_tier == ("disk" if disk else "none")
        sched.check()
        assert not sched.pre_shared and not sched.running
