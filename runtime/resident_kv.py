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
sequence be preempted (`reclaim`, called by the scheduler).

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

    def sole_blocks(self) -> int:
        """Blocks that only held prefixes reference (free once those are dropped)."""
        return self.pool.kept_only

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

    def reclaim(self, need: int) -> None:
        """Drop held entries, least recently used first, until `need` blocks are free or none
        is held (a block a live sequence shares frees only when that one ends too)."""
        while self.held and self.pool.free_blocks < need:
            key = next(iter(self.held))
            self.drop(key)
            self.evicted += 1
            log.debug("resident prefix %s dropped for room (%d blocks free)", key[:12],
                      self.pool.free_blocks)

    def clear(self) -> None:
        for key in list(self.held):
            self.drop(key)


def serve(cache: Any, chain: Sequence[Any], prompt_len: int, slot: int,
          context: int | None) -> tuple[int, bool]:
    """Serve the first links of a cached `chain` (`runtime.prefix_cache.Entry`, root first) from
    resident blocks into `slot` (`cache`: the `runtime.cache_ops.CacheManager`, its scheduler
    `sched` set): (links served, whether the draft got their feature rows into `context`, from
    their RAM copies, as a RAM restore gives them). The longest link held is taken whose chain is
    all in RAM; a link short of the leaf only where it ends on a block boundary (the rest is then
    restored into the slot's own blocks after it, which a copied partial block would overwrite);
    an exact repeat only with its logits at hand (no back-off into shared blocks)."""
    sched = cache.sched
    block = sched.config.block_tokens
    for i in range(len(chain) - 1, -1, -1):
        e = chain[i]
        rows = sched.resident.rows(e.key)
        if rows is None or rows < e.length or not all(x.in_ram for x in chain[:i + 1]) or \
                (i < len(chain) - 1 and e.length % block) or \
                (e.length == prompt_len and e.logits is None):
            continue
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
    return 0, True
