"""Prefix-cache entries whose KV rows are still in the device pool: served without a copy.

When a sequence snapshots rows [0, L) of its slot into a RAM entry, the blocks that hold those
rows are referenced once more, under the entry's key (`hold`): they stay in the device pool
after the sequence ends. A later prompt whose cached chain ends at that entry takes the blocks
into its slot's table by reference instead of restoring the RAM copy (`serve`, through
`Scheduler.share`: full blocks shared, the partially filled last one copied with the slot's
first step, as prefix sharing between live sequences does). The rows are the very rows the RAM
copy was taken from, so a served prompt continues exactly as a restored one (and a cold run).

No shared block is ever written: a sequence writes only rows at or past its own restored
length, which lie in its own blocks (the copied last block, or blocks allocated after); the
sequence that made the entry writes rows past L only, which a later sequence's copy of the
partial block overwrites before reading. Held blocks are the first to go when the pool is short:
least recently used first, dropped (a reference less) before an allocation would fail or a
sequence be preempted (`reclaim`, called by the scheduler). The prefix a waiting request would
be served from is not dropped for that request's room: where the pool lacks its whole prompt's
blocks, admission shares that prefix's blocks at once (`admission_hint`,
`Scheduler._take_shared`) and asks room only for the rest; its restore then serves that very
link, or `settle` gives it up for blocks of the slot's own first (no RAM copy is ever written
into shared blocks).

Attention-only models only: a hybrid model's entries also hold a recurrent state that no block
holds (the coordinator attaches this only to non-hybrid runs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from layersplit.ipc.messages import message
from layersplit.runtime.block_manager import BlockManager
from layersplit.runtime.errors import DraftError, DraftLost
from layersplit.shards.chunking import cut_points

log = logging.getLogger(__name__)


def table_key(key: str) -> Hashable:
    """The pool table under which an entry's blocks are held (never a slot number)."""
    return ("resident", key)


class ResidentBlocks:
    """Entry key -> rows held, least recently used first, over the scheduler's block pool."""

    def __init__(self, pool: BlockManager) -> None:
        self.pool = pool
        self.held: OrderedDict[str, int] = OrderedDict()
        self.evicted = 0  # entries whose blocks were dropped for room

    def sole_blocks(self, keep: str | None = None) -> int:
        """Blocks that only held prefixes reference (free once those are dropped); with
        `keep`, those that dropping every other one frees (`keep`'s blocks stay)."""
        if keep is None or keep not in self.held:
            return self.pool.kept_only
        pool = self.pool
        return pool.kept_only - sum(1 for b in pool.tables[table_key(keep)]
                                    if pool.refs[b] == pool.kept[b])

    def rows(self, key: str) -> int | None:
        """Rows [0, n) of the entry still in the device pool, or None."""
        return self.held.get(key)

    def hold(self, key: str, slot: Hashable, length: int) -> bool:
        """Reference the blocks of `slot` that hold rows [0, length) under `key` (the slot holds
        those rows now, computed or restored for the entry's tokens). False where it cannot."""
        if key in self.held:
            self.held.move_to_end(key)
            return True
        n = self.pool.blocks_for(length)
        if length < 1 or len(self.pool.tables.get(slot, ())) < n:
            return False
        self.pool.fork(slot, table_key(key), n * self.pool.block_tokens)  # (whole blocks: no
        # copy, each block one reference more)
        self.pool.mark_kept(table_key(key))
        self.held[key] = length
        return True

    def touch(self, key: str) -> None:
        self.held.move_to_end(key)

    def drop(self, key: str) -> None:
        if self.held.pop(key, None) is not None:
            self.pool.mark_kept(table_key(key), False)
            self.pool.free(table_key(key))

    def reclaim(self, need: int, keep: str | None = None) -> None:
        """Drop held entries, least recently used first, until `need` blocks are free or none
        but `keep` is held (a block a live sequence shares frees only when that one ends too)."""
        while self.pool.free_blocks < need:
            key = next((k for k in self.held if k != keep), None)
            if key is None:
                break
            self.drop(key)
            self.evicted += 1
            log.debug("resident prefix %s dropped for room (%d blocks free)", key[:12],
                      self.pool.free_blocks)

    def clear(self) -> None:
        for key in list(self.held):
            self.drop(key)


def _servable(chain: Sequence[Any], i: int, prompt_len: int, block: int) -> bool:
    """Whether link i of `chain` may be served from blocks: its chain all in RAM; short of the
    leaf only where it ends on a block boundary (the rest is then restored into the slot's own
    blocks after it, which a copied partial block would overwrite); an exact repeat only with
    its logits at hand (no back-off into shared blocks)."""
    e = chain[i]
    return all(x.in_ram for x in chain[:i + 1]) and \
        not (i < len(chain) - 1 and e.length % block) and \
        not (e.length == prompt_len and e.logits is None)


def pick(sched: Any, chain: Sequence[Any], prompt_len: int) -> int | None:
    """The link of `chain` to serve from resident blocks (`sched`: the scheduler): the longest
    held and servable, or None."""
    block = sched.config.block_tokens
    for i in range(len(chain) - 1, -1, -1):
        rows = sched.resident.rows(chain[i].key)
        if rows is not None and rows >= chain[i].length and \
                _servable(chain, i, prompt_len, block):
            return i
    return None


def admission_hint(batcher: Any, cache: Any) -> Any:
    """The scheduler's `resident_for` (`Scheduler.admit`): (key, rows) of the resident prefix a
    waiting request would be served from, for a new request that may take from the cache."""

    def resident_for(rid: Hashable, tokens: int) -> tuple[str, int] | None:
        req = batcher.requests.get(rid)
        if req is None or req.cached is None or req.prompt is None or \
                len(req.prompt) != tokens or cache.sched is None:
            return None  # (a preempted one runs again from more tokens than its prompt)
        prompt = req.prompt
        chain = cache._lookup(prompt, cut_points(prompt, cache.coord.chunk, cache.coord.eos_ids))
        i = pick(cache.sched, chain, len(prompt))
        return None if i is None else (chain[i].key, chain[i].length)

    return resident_for


def settle(sched: Any, slot: int, chain: list[Any], prompt_len: int) -> list[Any]:
    """Before a restore into `slot`: a prefix shared at admission that `chain` cannot serve
    any more (its entry left the RAM tier meanwhile) is given up for blocks of the slot's own
    (`Scheduler.unshare`); returns the links of `chain` the slot's table covers (all, unless
    the pool had too few blocks for that)."""
    pre = sched.pre_shared.get(slot)
    if pre is not None and _pre_link(sched, chain, prompt_len, pre) is None:
        sched.unshare(slot)
    held = sched.slot_tokens_held(slot)
    return [e for e in chain if e.length <= held]


def _pre_link(sched: Any, chain: Sequence[Any], prompt_len: int,
              pre: tuple[str, int]) -> int | None:
    block = sched.config.block_tokens
    return next((i for i, e in enumerate(chain) if (e.key, e.length) == pre and
                 _servable(chain, i, prompt_len, block)), None)


def serve(cache: Any, chain: Sequence[Any], prompt_len: int, slot: int,
          context: int | None) -> tuple[int, bool]:
    """Serve the first links of a cached `chain` (`runtime.prefix_cache.Entry`, root first) from
    resident blocks into `slot` (`cache`: the `runtime.cache_ops.CacheManager`, its scheduler
    `sched` set): (links served, whether the draft got their feature rows into `context`, from
    their RAM copies, as a RAM restore gives them). The link the slot took at admission
    (`settle` keeps it servable), else the longest one `pick` finds."""
    sched = cache.sched
    pre = sched.pre_shared.get(slot)
    i = pick(sched, chain, prompt_len) if pre is None else \
        _pre_link(sched, chain, prompt_len, pre)
    if i is None:
        return 0, True
    e = chain[i]
    if not sched.share_resident(slot, e.key, e.length):
        return 0, True
    cache.stats.hits_resident += 1
    cache.stats.tokens_resident += e.length
    feats = True
    if context is not None:  # (the draft keeps its rows in its own process, not in blocks)
        msg = message("snap_restore", entries=[x.ram_id for x in chain[:i + 1]],
                      slot=context, blocks=None)
        try:
            cache.coord.draft_request(msg)
        except (DraftLost, DraftError) as err:
            log.warning("prefix cache: the draft did not restore its feature rows: %s", err)
            feats = False
    return i + 1, feats
