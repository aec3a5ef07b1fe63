"""Which KV blocks each sequence holds: the paged KV pool's bookkeeping, pure Python (no tensors).

Every shard holds a pool of `num_blocks` blocks of `block_tokens` KV rows each, the SAME number
on every shard, so a block id means the same block everywhere and one table per sequence serves
the whole chain. A sequence's block table lists its blocks in position order: row p of the
sequence lives in block `table[p // block_tokens]` at offset `p % block_tokens`.

Blocks are reference counted: `fork` lets a sequence share another's full blocks (a common
prefix held once). A block shared by two tables is read-only; the partially filled last block
of the source is copied, not shared (copy on write): `fork` hands back the (src, dst) block
copies the shards must make before the new sequence writes into it, and holds each copy's
source (a pin of the new sequence) until `unpin`: the copy runs on the shards with the new
sequence's first step, and its source must not be reused before (its owner may end, or be
swapped out, meanwhile).

The shards never decide anything here: the coordinator allocates, and sends each shard the
table entries with the step that first uses them (`ipc.messages` SEGMENT `blocks`, `copy`).
"""

from __future__ import annotations

from collections.abc import Hashable


class BlockManager:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(f"block manager: {num_blocks} blocks of {block_tokens} tokens")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() = lowest id
        self.refs = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self.pins: dict[Hashable, list[int]] = {}  # seq -> the sources of its fork's copies
        # references of tables marked `kept` (prefixes held after their sequence ended,
        # `runtime.resident_kv`), and how many blocks only those reference (free once dropped)
        self.kept = [0] * num_blocks
        self.kept_only = 0

    # ---- queries ------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` rows."""
        return -(-max(tokens, 0) // self.block_tokens)

    @property
    def free_blocks(self) -> int:
        return len(self.free_ids)

    def table(self, seq: Hashable) -> list[int]:
        """The sequence's block table (a copy; empty for an unknown sequence)."""
        return list(self.tables.get(seq, ()))

    def needed(self, seq: Hashable, tokens: int) -> int:
        """New blocks `seq` needs to cover `tokens` rows."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq, ())))

    def can_allocate(self, tokens: int, seq: Hashable | None = None) -> bool:
        """Whether `seq` (None: a new sequence) can grow to `tokens` rows now."""
        return self.needed(seq, tokens) <= self.free_blocks

    # ---- changes ------------------------------------------------------------------------------
    def allocate(self, seq: Hashable, tokens: int) -> list[int]:
        """Grow `seq`'s table (a new one if unknown) to cover `tokens` rows; returns the new
        block ids, in table order. Raises MemoryError when the pool cannot (nothing changes)."""
        need = self.needed(seq, tokens)
        if need > self.free_blocks:
            raise MemoryError(f"KV pool: {need} blocks needed for {tokens} tokens, "
                              f"{self.free_blocks} of {self.num_blocks} free")
        new = [self.free_ids.pop() for _ in range(need)]
        for b in new:
            self.refs[b] = 1  # (a free block is referenced by no kept table)
        self.tables.setdefault(seq, []).extend(new)
        return new

    def free(self, seq: Hashable) -> None:
        """Drop `seq`'s table (and its pins); blocks nobody else references are free at once."""
        self._drop([*self.tables.pop(seq, ()), *self.pins.pop(seq, ())])

    def unpin(self, seq: Hashable) -> None:
        """`seq`'s fork copies are made (its first step is back): their sources may go."""
        self._drop(self.pins.pop(seq, ()))

    def mark_kept(self, seq: Hashable, kept: bool = True) -> None:
        """Count `seq`'s references as kept ones (`kept_only`), or no longer (before `free`)."""
        for b in self.tables.get(seq, ()):
            self._count(b, 0, 1 if kept else -1)

    def _count(self, b: int, refs: int, kept: int = 0) -> None:
        """Change block b's references (and its kept ones), keeping `kept_only` up to date."""
        k = self.kept[b]
        was = k > 0 and self.refs[b] == k
        self.refs[b] += refs
        self.kept[b] = k = k + kept
        self.kept_only += (k > 0 and self.refs[b] == k) - was

    def _drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self._count(b, -1)
            if self.refs[b] == 0:
                self.free_ids.append(b)
        if blocks:
            self.free_ids.sort(reverse=True)

    def fork(self, src: Hashable, dst: Hashable, tokens: int) -> list[tuple[int, int]]:
        """`dst` (a new sequence) starts with `src`'s first `tokens` rows: it shares src's full
        blocks among them by reference, and gets a copy of the partially filled last one (copy
        on write: both will write past it). Returns the (src block, dst block) copies to make
        before dst runs. Raises MemoryError (nothing changes) if no block is free for the copy."""
        if dst in self.tables:
            raise ValueError(f"fork: sequence {dst!r} already holds blocks")
        table = self.tables.get(src, [])
        if self.blocks_for(tokens) > len(table):
            raise ValueError(f"fork: {src!r} holds {len(table)} blocks, fewer than "
                             f"{tokens} tokens need")
        full, part = divmod(tokens, self.block_tokens)
        if part and not self.free_ids:
            raise MemoryError("KV pool: no free block for the copied last block of a fork")
        shared = table[:full]
        for b in shared:
            self._count(b, 1)
        self.tables[dst] = list(shared)
        copies = []
        if part:
            nb = self.free_ids.pop()
            self.refs[nb] = 1
            self.tables[dst].append(nb)
            copies.append((table[full], nb))
            self._count(table[full], 1)  # (held until the copy is made: `unpin`)
            self.pins[dst] = [table[full]]
        return copies

    def check_integrity(self) -> None:
        """No block leaked or owned twice; reference counts equal table references."""
        counted = [0] * self.num_blocks
        for seq, table in [*self.tables.items(), *self.pins.items()]:
            assert len(set(table)) == len(table), f"sequence {seq!r} lists a block twice"
            for b in table:
                assert 0 <= b < self.num_blocks, f"block id {b} outside the pool"
                counted[b] += 1
        assert counted == self.refs, "reference counts differ from table (and pin) references"
        assert all(0 <= k <= r for k, r in zip(self.kept, self.refs)), "kept references"
        assert self.kept_only == sum(1 for k, r in zip(self.kept, self.refs) if k and k == r), \
            "kept_only differs from the blocks only kept tables reference"
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is free twice"
        for b in range(self.num_blocks):
            assert (b in free) == (counted[b] == 0), \
                f"block {b}: {'free and held' if b in free else 'held by nobody, not free'}"
