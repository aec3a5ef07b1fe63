"""The shards' host memory as one budget (`runtime.host_pool`): swapped-out live KV
and the prefix cache's RAM tier share it, under one eviction policy.

- random swaps and snapshots never exceed any shard's budget, and the counts come back to
  their start once everything is freed;
- a swap-out that needs room evicts RAM-tier snapshots least recently used first (through the
  RAM tier's own policy, `PrefixIndex.evict_ram`), and only as many as it needs;
- swapped blocks are never evicted: a snapshot or a swap-out that does not fit beside them is
  refused, and one that cannot fit even without every snapshot evicts none;
- the sizing (`host_pool_plan`) and the config keys (`host_cache_gb` refuses the keys it
  replaces, by name).
"""

from __future__ import annotations

import random
import re

import pytest
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.prefix_cache import Entry, PrefixIndex


def _index(pool: HostPool) -> PrefixIndex:
    """A RAM-tier index whose evictions give room to the pool, as `CacheManager` wires it."""
    index = PrefixIndex("fp", 1 << 60, None, 0)

    def make_room(need):
        for ram_id in index.evict_ram_for(lambda gone: pool.fits(need, gone)):
            pool.drop_snapshot(ram_id)

    pool.make_room = make_room
    return index


def _snap(index: PrefixIndex, pool: HostPool, key: str, nbytes: tuple[int, ...],
          used: float, parent: str | None = None) -> Entry:
    ram_id = index.new_ram_id()
    e = Entry(key=key, length=10, start=0, parent=parent, tokens=(), logits=None,
              kv_bytes=sum(nbytes), ram_id=ram_id, last_used=used)
    index.add(e)
    pool.add_snapshot(ram_id, nbytes)
    return e


def test_a_swap_out_evicts_snapshots_least_recently_used_first():
    pool = HostPool([1000, 500], [100, 50])  # two shards, the second with half the layers
    index = _index(pool)
    a = _snap(index, pool, "a", (300, 150), used=3.0)
    b = _snap(index, pool, "b", (300, 150), used=1.0)  # the least recently used
    c = _snap(index, pool, "c", (300, 150), used=2.0)
    pool.check_integrity()
    assert pool.hold_swap("s1", 1)  # 100 / 50 bytes: still room, nothing evicted
    assert all(e.in_ram for e in (a, b, c))
    assert pool.hold_swap("s2", 4)  # 400 / 200 more: b goes, then c (LRU order), not a
    assert [e.key for e in (a, b, c) if e.in_ram] == ["a"]
    assert index.stats.evicted_ram == 2 and set(index.entries) == {"a"}
    assert pool.used == [800, 400]
    pool.check_integrity()


def test_swapped_blocks_are_never_evicted():
    pool = HostPool([1000], [100])
    index = _index(pool)
    assert pool.hold_swap("s1", 6) and pool.hold_swap("s2", 3)
    old = _snap(index, pool, "old", (100,), used=1.0).ram_id
    # a snapshot that does not fit beside the swapped blocks: the index finds nothing else to
    # evict (the swapped blocks are not its to evict), and the pool refuses it
    gone = index.evict_ram(room=lambda g: pool.fits((200,), g))
    assert gone == [old]  # only the snapshot went (the caller drops it)
    pool.drop_snapshot(old)
    assert not pool.fits((200,))
    with pytest.raises(MemoryError, match="does not fit"):
        pool.add_snapshot(99, (200,))
    # a swap-out that cannot fit even once every snapshot is gone evicts none of them
    keep = _snap(index, pool, "keep", (100,), used=2.0)
    assert not pool.hold_swap("s3", 2)
    assert keep.in_ram and "s3" not in pool.swapped and pool.used == [1000]
    assert pool.swapped == {"s1": (600,), "s2": (300,)}
    pool.check_integrity()


def test_no_snapshot_is_evicted_where_the_room_cannot_be_made():
    """Room that even every free RAM copy gone would not make (a copy in use stays, swapped
    blocks stay) evicts none: neither for a swap-out nor for a new snapshot."""
    pool = HostPool([1000], [100])
    index = _index(pool)
    busy = _snap(index, pool, "busy", (300,), used=1.0)
    busy.pins = 1  # being restored: its copy cannot go
    free = _snap(index, pool, "free", (100,), used=2.0)
    assert pool.hold_swap("s1", 5)  # 500: fits beside both (900 of 1000)
    # 300 more would fit only if the pinned copy went too: nothing is evicted, none held
    assert not pool.hold_swap("s2", 3)
    assert free.in_ram and busy.in_ram and "s2" not in pool.swapped
    # a new snapshot of 250 bytes: not even with `free` gone (its room check, as CacheManager's)
    assert index.evict_ram_for(lambda gone: pool.fits((250,), gone)) == []
    assert free.in_ram
    # 150 fits once `free` goes: it (only it) is evicted
    free_id = free.ram_id
    assert index.evict_ram_for(lambda gone: pool.fits((150,), gone)) == [free_id]
    pool.check_integrity()


def test_a_snapshot_with_a_child_is_evicted_after_it():
    """The RAM tier's policy holds for swaps too: a parent goes only once its child went."""
    pool = HostPool([300], [100])
    index = _index(pool)
    root = _snap(index, pool, "root", (100,), used=1.0)
    leaf = _snap(index, pool, "leaf", (100,), used=2.0, parent="root")
    other = _snap(index, pool, "other", (100,), used=3.0)
    assert pool.hold_swap("s", 2)  # 200: the leaf, then its root (older, but held by it)
    assert not root.in_ram and not leaf.in_ram and other.in_ram
    pool.check_integrity()


def test_the_budget_is_never_exceeded_and_counts_return_to_start():
    rng = random.Random(7)
    pool = HostPool([5000, 3000, 4000], [100, 60, 80])
    index = _index(pool)
    start = list(pool.used)
    swapped, clock = [], 0.0
    for step in range(2000):
        op = rng.random()
        clock += 1.0
        if op < 0.35:
            seq = f"s{step}"
            blocks = rng.randint(0, 12)
            before = dict(pool.snapshots)
            ok = pool.hold_swap(seq, blocks)
            if ok:
                swapped.append(seq)
            else:  # refused: only if it cannot fit even without every snapshot
                assert not pool.could_fit(pool.swap_need(blocks))
                assert pool.snapshots == before  # and then nothing was evicted for it
        elif op < 0.6 and swapped:
            pool.release_swap(swapped.pop(rng.randrange(len(swapped))))
        elif op < 0.9:
            rows = rng.randint(1, 30)
            need = (rows * 10, rows * 6, rows * 8)
            ram_id = index.new_ram_id()
            for gone in index.evict_ram(room=lambda g: pool.fits(need, g)):
                pool.drop_snapshot(gone)
            if pool.fits(need):
                pool.add_snapshot(ram_id, need)
                index.add(Entry(key=str(ram_id), length=rows, start=0, parent=None,
                                tokens=(), logits=None, kv_bytes=sum(need), ram_id=ram_id,
                                last_used=clock))
        elif index.entries:  # a restore touches an entry
            e = rng.choice(list(index.entries.values()))
            e.last_used = clock
        pool.check_integrity()
        assert {e.ram_id for e in index.entries.values()} == set(pool.snapshots)
    assert pool.swapped and pool.snapshots  # (the run exercised both)
    for seq in swapped:
        pool.release_swap(seq)
    for e in list(index.entries.values()):
        pool.drop_snapshot(e.ram_id)
    assert pool.used == start and not pool.swapped and not pool.snapshots
    pool.check_integrity()


def test_bad_pools_and_double_holds_are_refused():
    with pytest.raises(ValueError, match="2 capacities for 1 shards"):
        HostPool([1, 2], [3])
    with pytest.raises(ValueError, match="must be >= 0"):
        HostPool([-1], [3])
    pool = HostPool([1000], [100])
    assert pool.hold_swap("s", 1)
    with pytest.raises(ValueError, match="already swapped out"):
        pool.hold_swap("s", 1)
    pool.add_snapshot(1, (10,))
    with pytest.raises(ValueError, match="snapshot 1 is already held"):
        pool.add_snapshot(1, (10,))


@pytest.mark.parametrize("kw,match", [
    ({"host_cache_gb": 1.0, "kv_host_gb": 1.0},
     "host_cache_gb and kv_host_gb: host_cache_gb is the one host-memory budget"),
    ({"host_cache_gb": 1.0, "kv_host_blocks": 4}, "host_cache_gb and kv_host_blocks:"),
    ({"host_cache_gb": 1.0, "cache_ram_gb": 2.0}, "host_cache_gb and cache_ram_gb:"),
    ({"host_cache_gb": 1.0, "kv_host_gb": 0.0, "cache_ram_gb": 2.0},
     "host_cache_gb and kv_host_gb and cache_ram_gb:"),
    ({"host_cache_gb": -1.0}, "host_cache_gb=-1.0: must be a finite number >= 0"),
    ({"host_cache_gb": float("nan")}, "host_cache_gb=nan: must be a finite number >= 0"),
    ({"cache_ram_gb": float("inf")}, "cache_ram_gb=inf: must be a finite number >= 0"),
])
def test_contradictory_host_memory_keys_are_refused_by_name(kw, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        RuntimeConfig(**kw)


def test_host_pool_plan(tiny_llama):
    from layersplit.runtime.kv_pool import block_bytes, host_pool_plan
    from layersplit.runtime.placement import plan
    from layersplit.shards.checkpoint import open_checkpoint

    mc = open_checkpoint(tiny_llama, 0).config
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(2, 4))
    pl = plan(cfg, mc.num_layers, None)
    per = tuple(block_bytes(mc, s.end - s.start, 16, 4) for s in pl.shards)
    assert per[1] == 2 * per[0]
    # the old keys: the two budgets side by side (a swap never takes the RAM tier's room)
    legacy = host_pool_plan(RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"),
                                          split=(2, 4), kv_host_blocks=7, cache_ram_gb=1.0),
                            mc, pl, 4, 100)
    assert legacy.blocks == 7 and legacy.ram_cap == 2**30 and legacy.block_bytes == per
    assert legacy.capacity == (7 * per[0] + 2**30, 7 * per[1] + 2**30)
    assert host_pool_plan(cfg, mc, pl, 4, 100).ram_cap == 4 * 2**30  # cache_ram_gb's default
    # host_cache_gb: one budget per shard, as many block ids as the most loaded shard holds
    shared = host_pool_plan(RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"),
                                          split=(2, 4), host_cache_gb=0.5), mc, pl, 4, 100)
    assert shared.capacity == (2**29, 2**29) and shared.ram_cap is None
    assert shared.blocks == 2**29 // per[1]
    none = host_pool_plan(RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"),
                                        host_cache_gb=0.0), mc, pl, 4, 100)
    assert none.blocks == 0 and none.capacity == (0, 0)
