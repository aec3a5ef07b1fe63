"""The shards' host memory as one budget: swapped-out live KV and the prefix cache's RAM tier.

Each shard's host memory holds two kinds of things, both copies of its device KV:
- the blocks of sequences preempted by swap (`runtime.batching`), which must come back: they
  are never evicted while their sequence waits;
- the prefix cache's RAM-tier snapshots (`runtime.cache_ops`), which are a cache: they are
  evicted, least recently used first (`PrefixIndex.evict_ram`, the RAM tier's one policy), to
  make room, for a swap-out as for a newer snapshot.

`HostPool` is the ledger of both, pure Python, in bytes per shard (a shard holds only its own
layers' rows, so shards of a split hold different amounts): nothing is added unless it fits
every shard's capacity. A swap-out that does not fit asks `make_room` (the prefix cache, which
drops snapshots on the shards and here) and then is refused if it still does not fit: the
sequence is prefilled again, as without a host pool. A snapshot that does not fit after
evicting the others is not taken.

The shards allocate a swapped sequence's host blocks when it is swapped out and free them when
it comes back (or ends), and a snapshot's memory when it is taken and freed when dropped, so
the ledger is what the shards hold.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

Bytes = tuple[int, ...]  # one count per shard


class HostPool:
    def __init__(self, capacity: Sequence[int], block_bytes: Sequence[int]) -> None:
        """`capacity`: host bytes of each shard; `block_bytes`: bytes of one swapped KV block
        on each shard (its attention layers' K and V rows of one block)."""
        if not capacity or len(capacity) != len(block_bytes):
            raise ValueError(f"host pool: {len(capacity)} capacities for "
                             f"{len(block_bytes)} shards")
        if any(c < 0 for c in capacity) or any(b < 0 for b in block_bytes):
            raise ValueError(f"host pool: capacity {list(capacity)}, block bytes "
                             f"{list(block_bytes)} must be >= 0")
        self.capacity: Bytes = tuple(int(c) for c in capacity)
        self.block_bytes: Bytes = tuple(int(b) for b in block_bytes)
        self.swapped: dict[Hashable, Bytes] = {}  # sequence -> bytes of its swapped blocks
        self.snapshots: dict[int, Bytes] = {}  # RAM-tier snapshot id -> its bytes
        self.used: list[int] = [0] * len(self.capacity)
        # need -> evict snapshots (through `drop_snapshot`) until it fits, if it can
        self.make_room: Callable[[Bytes], None] | None = None

    # ---- queries ------------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        return len(self.capacity)

    def swap_need(self, blocks: int) -> Bytes:
        """Bytes each shard needs for `blocks` swapped KV blocks."""
        return tuple(blocks * b for b in self.block_bytes)

    def fits(self, need: Sequence[int], without: Iterable[int] = ()) -> bool:
        """Whether `need` more bytes fit every shard now (once the snapshots `without` are
        dropped)."""
        gone = [0] * self.shards
        for sid in set(without):
            for i, n in enumerate(self.snapshots.get(sid, ())):
                gone[i] += n
        return all(u - g + n <= c for u, g, n, c in zip(self.used, gone, need, self.capacity))

    def could_fit(self, need: Sequence[int]) -> bool:
        """Whether `need` fits once every snapshot is evicted (swapped blocks stay)."""
        return self.fits(need, without=list(self.snapshots))

    def snapshot_bytes(self) -> Bytes:
        return self._sum(self.snapshots.values())

    def swapped_bytes(self) -> Bytes:
        return self._sum(self.swapped.values())

    # ---- swapped live KV: never evicted -------------------------------------------------------
    def hold_swap(self, seq: Hashable, blocks: int) -> bool:
        """Room for `seq`'s `blocks` swapped blocks, evicting snapshots (least recently used
        first, `make_room`) where needed; False (nothing held) if even that leaves too little."""
        if seq in self.swapped:
            raise ValueError(f"host pool: sequence {seq!r} is already swapped out")
        need = self.swap_need(blocks)
        if not self.could_fit(need):
            return False
        if not self.fits(need) and self.make_room is not None:
            self.make_room(need)
        if not self.fits(need):
            return False
        self.swapped[seq] = need
        self._add(need, 1)
        return True

    def release_swap(self, seq: Hashable) -> None:
        """`seq`'s blocks came back (or it ended): their host memory is free."""
        need = self.swapped.pop(seq, None)
        if need is not None:
            self._add(need, -1)

    # ---- RAM-tier snapshots: evicted least recently used --------------------------------------
    def add_snapshot(self, sid: int, need: Sequence[int]) -> None:
        """Account a snapshot the shards now hold; raises MemoryError if it does not fit
        (the caller evicts first, `PrefixIndex.evict_ram`)."""
        if sid in self.snapshots:
            raise ValueError(f"host pool: snapshot {sid} is already held")
        need = tuple(int(n) for n in need)
        if len(need) != self.shards or not self.fits(need):
            raise MemoryError(f"host pool: a snapshot of {list(need)} bytes does not fit "
                              f"(used {self.used} of {list(self.capacity)})")
        self.snapshots[sid] = need
        self._add(need, 1)

    def drop_snapshot(self, sid: int) -> None:
        need = self.snapshots.pop(sid, None)
        if need is not None:
            self._add(need, -1)

    # ---- internals ----------------------------------------------------------------------------
    def _add(self, need: Bytes, sign: int) -> None:
        for i, n in enumerate(need):
            self.used[i] += sign * n

    def _sum(self, items: Iterable[Bytes]) -> Bytes:
        total = [0] * self.shards
        for need in items:
            for i, n in enumerate(need):
                total[i] += n
        return tuple(total)

    def check_integrity(self) -> None:
        """The counts equal what is held, and no shard's budget is exceeded."""
        for what, items in (("swapped", self.swapped), ("snapshot", self.snapshots)):
            for key, need in items.items():
                assert len(need) == self.shards and all(n >= 0 for n in need), \
                    f"{what} {key!r}: bytes {need}"
        held = [a + b for a, b in zip(self.swapped_bytes(), self.snapshot_bytes())]
        assert held == self.used, f"used {self.used} differs from what is held ({held})"
        assert all(u <= c for u, c in zip(self.used, self.capacity)), \
            f"used {self.used} exceeds the capacity {list(self.capacity)}"
