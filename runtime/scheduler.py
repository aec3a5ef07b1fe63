"""Which requests hold KV-cache slots, and which sequences go into each step: pure bookkeeping,
no tensors, no processes (`runtime.batching` drives it).

- **Slots and blocks.** Each shard's KV cache is a pool of `num_blocks` blocks of
  `block_tokens` rows (`runtime.block_manager`, the same block ids on every shard); `slots`
  only bounds how many sequences run at once, and `slot_tokens` (max_context) how long one may
  grow. A running sequence holds one slot and a block table covering the rows it has reached;
  rows a prefix-cache restore put into the slot are its own blocks, like the rows it computes.
  A request is admitted, first come first served, when a slot and the blocks of its whole
  prompt are free (a chunked prefill then rarely runs out), or its blocks past the full ones
  of the resident prefix it would be served from (`runtime.resident_kv`: shared at once; where
  its restore gives that prefix up, `unshare` may leave it fewer than its prompt's blocks); a
  step grows the table first (`grow`), and when the pool is full the driver waits or preempts
  a sequence (`runtime.batching`). The shards learn each table from the messages that use it
  (`table_update`).
- **Swapped sequences.** A sequence preempted by swap (`swap_out`: its blocks' rows went to
  the shards' host pools) keeps its slot and its place at the head of the queue, with no
  blocks; `admit` gives it back the blocks of its next step first (before any new request), in
  the same slot, and the driver copies its rows back in before that step goes out.
- **Micro-batches.** Slots are split into `micro_batches` contiguous groups; a sequence runs in
  the group of its slot. The driver keeps one step of each group in flight, so with N groups
  shard i works on group k's step while shard i+1 works on group k-1's. New sequences go to the
  group with the fewest.
- **Steps.** A group's next step takes every decode (and verify) segment that is ready, then
  prefill chunks, oldest request first, while the step's row budget (`step_tokens`) allows:
  a long prompt never holds up the tokens of running streams by more than one chunk per step,
  and no request waits behind an unbounded stream of later ones (admission is FIFO, prefill is
  oldest first).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from layersplit.runtime.block_manager import BlockManager
from layersplit.runtime.resident_kv import ResidentBlocks, table_key


class PoolFull(RuntimeError):
    """The KV pool has too few free blocks for a grow (nothing changed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    slots: int
    slot_tokens: int  # KV rows per slot (max_context)
    block_tokens: int  # KV accounting granularity
    micro_batches: int
    step_tokens: int  # rows one step may carry
    num_blocks: int | None = None  # blocks in the KV pool; None: slots x blocks_per_slot

    def __post_init__(self) -> None:
        if self.slots < 1 or self.slot_tokens < 1 or self.block_tokens < 1 or \
                (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError(f"scheduler: bad sizes {self}")
        if not 1 <= self.micro_batches <= self.slots:
            raise ValueError(f"micro_batches={self.micro_batches} must be 1..slots ({self.slots})")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens={self.step_tokens} must be at least 1")

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.slot_tokens // self.block_tokens)

    @property
    def pool_blocks(self) -> int:
        return self.num_blocks if self.num_blocks is not None else \
            self.slots * self.blocks_per_slot


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """A running sequence's next segment: `rows` rows; `decode` for a decode or verify step (a
    token stream waits on it), else a prefill chunk."""

    rid: Hashable
    rows: int
    decode: bool


@dataclasses.dataclass(slots=True)
class Running:
    rid: Hashable
    slot: int
    group: int
    order: int  # admission order (oldest first)
    blocks: int = 0  # blocks in its table


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        c = config
        self.pool = BlockManager(c.pool_blocks, c.block_tokens)  # tables keyed by slot
        # blocks kept for prefix-cache entries after their sequence ended (`runtime.resident_kv`):
        # dropped, least recently used first, whenever the pool is short
        self.resident = ResidentBlocks(self.pool)
        # (rid, prompt tokens) -> (key, rows) of the resident prefix a waiting request would be
        # served from (`runtime.resident_kv.admission_hint`); None: no resident prefixes
        self.resident_for: Callable[[Hashable, int], tuple[str, int] | None] | None = None
        self.pre_shared: dict[int, tuple[str, int]] = {}  # slot -> (key, rows) it took at
        # admission, until its restore serves them (`share_resident`) or gives them up
        self.sent: dict[int, int] = {}  # slot -> table entries the shards were sent
        self.copies: dict[int, list[list[int]]] = {}  # slot -> block copies not sent yet
        bounds = [g * c.slots // c.micro_batches for g in range(c.micro_batches + 1)]
        self.group_slots = [range(bounds[g], bounds[g + 1]) for g in range(c.micro_batches)]
        self.free_slots: list[list[int]] = [list(r) for r in self.group_slots]
        self.waiting: deque[tuple[Hashable, int]] = deque()  # (rid, prompt tokens)
        self.running: dict[Hashable, Running] = {}
        self.swapped: dict[Hashable, Running] = {}  # swapped out: slot kept, no blocks
        self._order = 0
        self._requeued: dict[Hashable, int] = {}  # rid -> its admission order, kept while a
        # preempted sequence waits to run again (it stays older than those admitted after it)

    # ---- admission ----------------------------------------------------------------------------
    def submit(self, rid: Hashable, prompt_tokens: int) -> None:
        if rid in self.running or rid in self.swapped or any(r == rid for r, _ in self.waiting):
            raise ValueError(f"request {rid!r} is already known")
        if not 0 < prompt_tokens <= self.config.slot_tokens:
            raise ValueError(f"request {rid!r}: a prompt of {prompt_tokens} tokens does not fit "
                             f"a slot of {self.config.slot_tokens}")
        if self._blocks(prompt_tokens) > self.total_blocks:
            raise ValueError(f"request {rid!r}: a prompt of {prompt_tokens} tokens does not fit "
                             f"the KV pool of {self.total_blocks} blocks of "
                             f"{self.config.block_tokens} tokens")
        self.waiting.append((rid, prompt_tokens))

    def admit(self) -> list[tuple[Hashable, int]]:
        """Admit waiting requests in arrival order while a slot and their prompt's blocks are
        free; returns (rid, slot) of each. The first that does not fit stops admission (FIFO:
        a large request is not overtaken forever by small ones)."""
        admitted = []
        while self.waiting:
            rid, prompt = self.waiting[0]
            need = self._blocks(prompt)
            if rid in self.swapped:  # back in its own slot, with blocks of its own
                if not self._room(need):
                    break
                self.waiting.popleft()
                r = self.running[rid] = self.swapped.pop(rid)
                self.sent.pop(r.slot, None)  # a new table: the next message sends it whole
                self._take(r, need)
                admitted.append((rid, r.slot))
                continue
            group = self._emptiest_group()
            if group is None:
                break
            pre = self._resident_share(rid, prompt, need)
            if pre is None and not self._room(need):
                break
            self.waiting.popleft()
            slot = self.free_slots[group].pop(0)
            order = self._requeued.pop(rid, None)
            if order is None:
                order, self._order = self._order, self._order + 1
            self.running[rid] = Running(rid, slot, group, order)
            self.pool.free(slot)  # (a table `Coordinator.forward` left there)
            self.sent.pop(slot, None)  # a new table: the next message for the slot sends it
            if pre is None:
                self._take(self.running[rid], need)
            else:
                self._take_shared(self.running[rid], need, *pre)
            admitted.append((rid, slot))
        return admitted

    def _resident_share(self, rid: Hashable, prompt: int, need: int) -> tuple[str, int] | None:
        """Where the pool lacks the prompt's blocks: (key, rows) of the resident prefix the
        request would be served from, when the blocks past its full ones fit with that prefix
        kept (others dropped, least recently used first, for the room); else None (admission
        then drops it like any held prefix, and the restore copies its rows in from RAM)."""
        if self.free_blocks >= need or self.resident_for is None or not self.resident.held:
            return None
        pre = self.resident_for(rid, prompt)
        if pre is None:
            return None
        key, tokens = pre
        full = tokens // self.config.block_tokens
        held = self.resident.rows(key)
        if held is None or held < tokens or not full or not self._room(need - full, keep=key):
            return None
        return pre

    def _take_shared(self, r: Running, need: int, key: str, tokens: int) -> None:
        """The new sequence's table starts with rows [0, tokens) of the resident prefix `key`
        (full blocks shared, the partial last one copied with its first step, as `share`
        does), then blocks of its own up to `need` (the room `_resident_share` made)."""
        self.copies[r.slot] = [list(c) for c in self.pool.fork(table_key(key), r.slot, tokens)]
        self.pool.allocate(r.slot, need * self.config.block_tokens)
        r.blocks = need
        self.pre_shared[r.slot] = (key, tokens)
        self.resident.touch(key)

    def unshare(self, slot: int) -> None:
        """The sequence in `slot` does not start with the prefix it shared at admission (its
        restore cannot serve it): its table becomes blocks of its own, as many as its shared
        table had where the pool has them (fewer otherwise: its steps grow it)."""
        self.pre_shared.pop(slot)
        r = self._running_in(slot)
        assert r is not None, f"slot {slot} shares a prefix but runs no sequence"
        want, r.blocks = r.blocks, 0
        self.pool.free(slot)
        self.copies.pop(slot, None)
        self._room(want)
        r.blocks = min(want, self.free_blocks)
        if r.blocks:
            self.pool.allocate(slot, r.blocks * self.config.block_tokens)

    def _running_in(self, slot: int) -> Running | None:
        """The running sequence in `slot`, or None."""
        return next((r for r in self.running.values() if r.slot == slot), None)

    def requeue(self, rid: Hashable, tokens: int) -> None:
        """A running sequence preempted: its slot and blocks are free at once, and it waits at
        the head of the queue to run again from `tokens` tokens (its prompt and the tokens it
        generated). It keeps its age: preemption picks the youngest, and one preempted must
        not become the youngest and be picked again and again."""
        self._requeued[rid] = self.running[rid].order
        self.release(rid)
        self.waiting.appendleft((rid, tokens))

    def swap_out(self, rid: Hashable, tokens: int) -> None:
        """A running sequence preempted by swap: its blocks are free at once, it keeps its
        slot, and it waits at the head of the queue for the blocks of `tokens` rows (its next
        step's) to come back in that slot."""
        if self._blocks(tokens) > self.total_blocks:
            raise ValueError(f"request {rid!r}: {tokens} tokens exceed the KV pool")
        r = self._drop_blocks(rid)
        r.blocks = 0
        self.swapped[rid] = r
        self.waiting.appendleft((rid, tokens))

    def _emptiest_group(self) -> int | None:
        best = None
        for g, free in enumerate(self.free_slots):
            if free and (best is None or len(free) > len(self.free_slots[best])):
                best = g
        return best

    # ---- KV blocks ----------------------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks

    @property
    def reclaimable_blocks(self) -> int:
        """Free blocks, and those only resident prefixes hold (dropped when needed)."""
        return self.free_blocks + self.resident.sole_blocks()

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.block_tokens)

    def _room(self, need: int, keep: str | None = None) -> bool:
        """Whether `need` blocks are free, once blocks held for resident prefixes (but `keep`)
        are dropped where they must be (least recently used first). None is dropped where
        dropping every one would still leave too few: their blocks would be freed for nobody."""
        if self.free_blocks < need <= self.free_blocks + self.resident.sole_blocks(keep):
            self.resident.reclaim(need, keep)
        return need <= self.free_blocks

    def _take(self, r: Running, blocks: int) -> None:
        extra = blocks - r.blocks
        if extra <= 0:
            return
        if blocks > self.config.blocks_per_slot or not self._room(extra):
            raise PoolFull(f"request {r.rid!r}: {blocks} KV blocks exceed its slot or the "
                           f"{self.free_blocks} free")
        self.pool.allocate(r.slot, blocks * self.config.block_tokens)
        r.blocks = blocks

    def can_grow(self, rid: Hashable, tokens: int) -> bool:
        """Whether the pool has the blocks for the sequence to reach `tokens` rows now."""
        return self.can_grow_all({rid: tokens})

    def can_grow_all(self, tokens: dict[Hashable, int]) -> bool:
        """Whether the pool has the blocks for every sequence (rid -> rows) to grow at once."""
        return self._room(sum(max(0, self._blocks(n) - self.running[rid].blocks)
                              for rid, n in tokens.items()))

    def grow(self, rid: Hashable, tokens: int) -> None:
        """The sequence's slot now holds `tokens` rows (restored and computed alike): its
        table covers them (PoolFull, nothing changed, when the pool cannot)."""
        if tokens > self.config.slot_tokens:
            raise ValueError(f"request {rid!r}: {tokens} tokens exceed a slot of "
                             f"{self.config.slot_tokens}")
        self._take(self.running[rid], self._blocks(tokens))

    def table_update(self, slot: int) -> dict[str, Any] | None:
        """The entries of `slot`'s block table the shards were not sent yet, as a message's
        `blocks` field ({at, ids}; at = 0 for a sequence new to the slot), or None; from now
        on they count as sent (the caller sends them with its next message for the slot)."""
        table = self.pool.tables.get(slot)
        sent = self.sent.get(slot, 0)
        if not table or (sent == len(table) and slot in self.sent):
            return None
        self.sent[slot] = len(table)
        return {"at": sent, "ids": table[sent:]}

    def hold_slot(self, slot: int, tokens: int, new: bool) -> None:
        """A slot driven step by step outside admission (`Coordinator.forward`, traces and
        tests): its table covers `tokens` rows (`new`: a new sequence starts in it)."""
        if not 0 <= slot < self.config.slots or any(
                r.slot == slot for r in (*self.running.values(), *self.swapped.values())):
            raise ValueError(f"slot {slot} is not free to drive by hand")
        if tokens > self.config.slot_tokens:
            raise ValueError(f"{tokens} tokens exceed max_context {self.config.slot_tokens}")
        if new:
            self.pool.free(slot)
            self.sent.pop(slot, None)
        self._room(self.pool.needed(slot, tokens))
        self.pool.allocate(slot, tokens)

    def share(self, rid: Hashable, src_slot: Hashable, tokens: int) -> None:
        """The just-admitted sequence `rid` starts with the first `tokens` rows of the sequence
        in `src_slot` (the same tokens, already prefilled there; or a resident prefix's table,
        `runtime.resident_kv`): it shares their full blocks and copies the partial last one
        (`copy_update`), instead of blocks of its own."""
        r = self.running[rid]
        if r.slot in self.sent or r.slot == src_slot:
            raise ValueError(f"request {rid!r}: share only before its slot's first message")
        self.pool.free(r.slot)
        self.pre_shared.pop(r.slot, None)  # (a live prefix longer than the one it took)
        self.copies[r.slot] = [list(c) for c in self.pool.fork(src_slot, r.slot, tokens)]
        self.pool.allocate(r.slot, r.blocks * self.config.block_tokens)

    def share_resident(self, slot: int, key: str, tokens: int) -> bool:
        """The sequence just admitted into `slot` starts with rows [0, tokens) of the resident
        prefix `key` (`share`); False (nothing changed) where it cannot: no such prefix held,
        or the slot is not a new sequence's."""
        pre = self.pre_shared.get(slot)
        if pre is not None:  # (taken at admission: `_take_shared`)
            if pre != (key, tokens):
                raise ValueError(f"slot {slot} shares {pre[1]} rows of prefix {pre[0][:12]} "
                                 f"since admission, not {tokens} of {key[:12]}")
            del self.pre_shared[slot]
            if key in self.resident.held:
                self.resident.touch(key)
            return True
        held = self.resident.rows(key)
        r = self._running_in(slot)
        if held is None or held < tokens or r is None or slot in self.sent or \
                self.copies.get(slot) or slot in self.pool.pins or \
                tokens > r.blocks * self.config.block_tokens or \
                any(self.pool.refs[b] != 1 for b in self.pool.tables.get(slot, ())):
            return False  # (its own blocks, freed, make the room the share takes)
        self.share(r.rid, table_key(key), tokens)
        self.resident.touch(key)
        return True

    def copied(self, slot: int) -> None:
        """A step of the slot's sequence is back: the block copies its first step carried are
        made on every shard, so their sources need no longer be held."""
        if slot not in self.copies:
            self.pool.unpin(slot)

    def copy_update(self, slot: int) -> list[list[int]] | None:
        """The block copies the slot's next step must make first (a message's `copy`), or
        None; from now on they count as sent."""
        return self.copies.pop(slot, None) or None

    def slot_tokens_held(self, slot: int) -> int:
        """Rows the slot's table covers."""
        return len(self.pool.tables.get(slot, ())) * self.config.block_tokens

    def drop_held(self, slot: int) -> None:
        """A slot driven by hand (`hold_slot`) is done with: its blocks are free, and the
        next sequence in it starts a table of its own."""
        if any(r.slot == slot for r in (*self.running.values(), *self.swapped.values())):
            raise ValueError(f"slot {slot} holds a running sequence, not one driven by hand")
        self.pool.free(slot)
        self.sent.pop(slot, None)

    def release(self, rid: Hashable) -> None:
        """A sequence finished, failed or was cancelled (with no step of it in flight): its
        slot and blocks are free at once."""
        self._free_slot(self._drop_blocks(rid))

    def _drop_blocks(self, rid: Hashable) -> Running:
        """The running sequence's blocks (and what the shards were to learn of its table) are
        free; it is no longer running."""
        r = self.running.pop(rid)
        self.pool.free(r.slot)
        self.sent.pop(r.slot, None)
        self.copies.pop(r.slot, None)
        self.pre_shared.pop(r.slot, None)
        return r

    def _free_slot(self, r: Running) -> None:
        free = self.free_slots[r.group]
        free.append(r.slot)
        free.sort()

    def cancel_waiting(self, rid: Hashable) -> bool:
        """Drop a request that was not admitted yet (a swapped one's slot is free at once);
        False if it is not waiting."""
        for i, (r, _) in enumerate(self.waiting):
            if r == rid:
                del self.waiting[i]
                self._requeued.pop(rid, None)
                held = self.swapped.pop(rid, None)
                if held is not None:
                    self._free_slot(held)
                return True
        return False

    # ---- steps --------------------------------------------------------------------------------
    def plan(self, ready: Sequence[Ready]) -> list[Hashable]:
        """The sequences of the next step, from the ready segments of one group (or of any
        group, for prefill chunks that need not wait): decode segments first, then prefill
        chunks oldest first, within the row budget (a step always takes at least one)."""
        budget = self.config.step_tokens
        by_age = sorted(ready, key=lambda s: (not s.decode, self.running[s.rid].order))
        chosen, rows = [], 0
        for s in by_age:
            if chosen and rows + s.rows > budget:
                if s.decode:
                    continue
                break  # prefill stays oldest first: a younger chunk does not jump the queue
            chosen.append(s.rid)
            rows += s.rows
        return chosen

    def group_of(self, rid: Hashable) -> int:
        return self.running[rid].group

    def check(self) -> None:
        """Invariants (the property tests call this after every operation)."""
        held = [r.slot for r in (*self.running.values(), *self.swapped.values())]
        free = [s for f in self.free_slots for s in f]
        assert len(set(held)) == len(held), "a slot is held twice"
        assert not set(held) & set(free), "a held slot is also free"
        assert sorted(held + free) == list(range(self.config.slots)), "a slot leaked"
        for r in self.running.values():
            assert r.slot in self.group_slots[r.group], "a sequence runs outside its group"
            assert 0 <= r.blocks <= self.config.blocks_per_slot
        held_blocks = {b for t in (*self.pool.tables.values(), *self.pool.pins.values())
                       for b in t}
        assert self.free_blocks + len(held_blocks) == self.total_blocks, \
            "KV blocks leaked or double-counted"
        self.pool.check_integrity()
        assert set(self.pool.tables) | set(self.pool.pins) <= \
            {r.slot for r in self.running.values()} | {table_key(k) for k in self.resident.held}, \
            "a block table (or pin) outlived its sequence"
        assert set(self.pre_shared) <= {r.slot for r in self.running.values()} - set(self.sent), \
            "a prefix shared at admission outlived its sequence (or its first message)"
        waiting = {rid for rid, _ in self.waiting}
        for r in self.swapped.values():
            assert r.blocks == 0 and r.rid in waiting, "a swapped sequence holds blocks or " \
                                                       "does not wait"
        assert set(self._requeued) <= waiting, "a preempted sequence's age outlived its wait"
        for r in self.running.values():
            assert len(self.pool.tables.get(r.slot, ())) == r.blocks
