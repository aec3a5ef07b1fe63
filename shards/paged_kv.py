"""Paged KV cache of one layer range: a pool of fixed-size blocks and a block table per slot.

Layout per tensor: (layers, num_blocks + 1, block, kv_heads, head_dim). Row p of the sequence in
slot s lives in block `tables[s][p // block]` at offset `p % block`. Block ids are global (the
coordinator's `runtime.block_manager` hands them out; every shard has the same number), so a
table travels with the step through the chain (`ipc.messages` SEGMENT `blocks`). The last block,
id `num_blocks`, is the scratch block: table entries past a slot's length point there, and a
batched step's padding rows write there (`scratch_pos`), so a padding row never changes a live
row and a masked read past a table's end reads finite rows.

Attention reads K/V through the table. The exact path (CPU, eager steps) gathers the rows
[0, kv_len) of the slot into contiguous tensors and runs the same math on them as over the
contiguous `shards.kv_cache.KVCache`: the output is bit-identical. The index tensors a step
needs are computed once per step (`StepInfo.paged`) and shared by its layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from layersplit.shards.device import to_device
from layersplit.shards.kv_cache import KVLayout

if TYPE_CHECKING:
    from layersplit.shards.layers.step import StepInfo


class PagedKVCache:
    def __init__(
        self,
        layout: KVLayout,
        max_len: int,
        slots: int,
        num_blocks: int,
        block: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block < 1:
            raise ValueError(f"paged KV cache: {num_blocks} blocks of {block} tokens")
        self.layout, self.max_len, self.slots = layout, max_len, slots
        self.num_blocks, self.block = num_blocks, block
        self.max_blocks = -(-max_len // block)  # table entries a sequence may hold
        self.scratch_pos = self.max_blocks * block  # a position whose row is the scratch block's
        shape = (layout.layers, num_blocks + 1, block, layout.kv_heads, layout.head_dim)
        self.k_store = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v_store = torch.zeros(shape, dtype=layout.dtype, device=device)
        flat = (layout.layers, (num_blocks + 1) * block, layout.kv_heads, layout.head_dim)
        self.k_rows, self.v_rows = self.k_store.view(flat), self.v_store.view(flat)
        self.tables: list[list[int]] = [[] for _ in range(slots)]  # host copy
        # device copy, one column more than a table may hold: always the scratch block
        self.table = torch.full((slots, self.max_blocks + 1), num_blocks, dtype=torch.long,
                                device=device)

    @property
    def nbytes(self) -> int:
        """Bytes allocated, scratch block included."""
        return 2 * self.k_store.numel() * self.k_store.element_size()

    @property
    def device(self) -> torch.device:
        return self.k_store.device

    # ---- tables -------------------------------------------------------------------------------
    def capacity(self, slot: int) -> int:
        """Rows the slot's table covers."""
        return len(self.tables[slot]) * self.block

    def table_error(self, slot: int, at: int, ids: Sequence[int]) -> str | None:
        """Why `set_table(slot, at, ids)` would be wrong, or None."""
        if not 0 <= slot < self.slots:
            return f"slot {slot} outside 0..{self.slots - 1}"
        if not isinstance(at, int) or isinstance(at, bool) or \
                not 0 <= at <= len(self.tables[slot]):
            return f"at={at!r} outside the slot's table of {len(self.tables[slot])} blocks"
        if not isinstance(ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.num_blocks
                for b in ids):
            return f"ids must be block ids 0..{self.num_blocks - 1}, got {str(ids)[:120]}"
        table = self.tables[slot][:at] + ids
        if len(table) > self.max_blocks:
            return (f"a table of {len(table)} blocks exceeds the {self.max_blocks} of "
                    f"max_context {self.max_len}")
        if len(set(table)) != len(table):
            return "the table would list a block twice"
        return None

    def set_table(self, slot: int, at: int, ids: Sequence[int]) -> None:
        """Entries [at, at + len(ids)) of the slot's table become `ids`; the table ends there
        (at = 0: a new sequence's table)."""
        old = len(self.tables[slot])
        self.tables[slot] = self.tables[slot][:at] + list(ids)
        end = at + len(ids)
        if ids:  # only the entries that change (a long table grows a block at a time)
            self.table[slot, at:end].copy_(to_device(list(ids), self.table.device))
        if old > end:
            self.table[slot, end:old].fill_(self.num_blocks)

    def copy_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy block src to block dst in every layer, for each [src, dst] (copy on write)."""
        if not pairs:
            return
        idx = to_device([p for pair in pairs for p in pair], self.k_store.device).view(-1, 2)
        self.k_store[:, idx[:, 1]] = self.k_store[:, idx[:, 0]]
        self.v_store[:, idx[:, 1]] = self.v_store[:, idx[:, 0]]

    def flat_rows(self, slot: int, rows: torch.Tensor,
                  table: torch.Tensor | None = None) -> torch.Tensor:
        """Indices into the flattened pool (`k_rows`) of positions `rows` of `slot` (of the
        sequence whose block table is `table`, when given)."""
        b = self.block
        table = self.table[slot] if table is None else table
        return table[rows // b] * b + rows % b

    def _host_rows(self, slot: int, rows: Sequence[int]) -> torch.Tensor:
        if rows and max(rows) >= self.capacity(slot):
            raise IndexError(f"KV rows up to {max(rows)} of slot {slot} outside its block table "
                             f"of {self.capacity(slot)} rows")
        return self.flat_rows(slot, to_device(list(rows), self.k_store.device))

    # ---- attention ----------------------------------------------------------------------------
    def _step_index(self, slot: int, step: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows written, rows read) of one slot's step, as pool indices; once per step."""
        got = step.paged.get(slot)
        if got is None:
            dev = self.k_store.device
            if step.pos is not None:  # eager: every index known on the host
                n = step.positions.shape[0]
                if step.kv_len > self.capacity(slot):
                    raise IndexError(f"slot {slot}'s block table covers {self.capacity(slot)} "
                                     f"rows; the step needs {step.kv_len}")
                write = self.flat_rows(slot, torch.arange(step.pos, step.pos + n, device=dev))
            else:  # a captured graph: positions (and the table, `step.tables`) on the device
                rows = step.positions if step.rows is None else step.rows
                write = self.flat_rows(slot, rows, self._table_of(step))
            read = self.flat_rows(slot, torch.arange(step.kv_len, device=dev),
                                  self._table_of(step))
            got = step.paged[slot] = (write, read)
        return got

    @staticmethod
    def _table_of(step: StepInfo) -> torch.Tensor | None:
        return None if step.tables is None else step.tables[0]

    def append(
        self, layer: int, slot: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's rows and return the rows it attends, [0, step.kv_len), gathered:
        (kv_len, kv_heads, head_dim) each."""
        if step.kv_len > self.scratch_pos:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        write, read = self._step_index(slot, step)
        self.k_rows[layer].index_copy_(0, write, k)
        self.v_rows[layer].index_copy_(0, write, v)
        return self.k_rows[layer].index_select(0, read), self.v_rows[layer].index_select(0, read)

    def append_batch(
        self, layer: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store row b of a batched step at position `step.positions[b]` of slot
        `step.slots[b]` (the scratch block for a padding row) and return the rows each attends,
        [0, kv_len) of its own slot, gathered: (B, kv_len, kv_heads, head_dim) each."""
        if step.kv_len > self.scratch_pos:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        got = step.paged.get("batch")
        if got is None:
            b, dev = self.block, self.k_store.device
            tables = self.table[step.slots] if step.tables is None else step.tables  # (B, W)
            pos = step.positions
            write = tables.gather(1, (pos // b)[:, None])[:, 0] * b + pos % b
            keys = torch.arange(step.kv_len, device=dev)
            read = tables[:, keys // b] * b + keys % b  # (B, kv_len)
            got = step.paged["batch"] = (write, read)
        write, read = got
        self.k_rows[layer].index_copy_(0, write, k)
        self.v_rows[layer].index_copy_(0, write, v)
        shape = (*read.shape, *k.shape[1:])
        return (self.k_rows[layer].index_select(0, read.reshape(-1)).view(shape),
                self.v_rows[layer].index_select(0, read.reshape(-1)).view(shape))

    # ---- rows ---------------------------------------------------------------------------------
    def move_rows(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy rows `src` of every layer of `slot` to rows `dst` (a tree verify's kept path)."""
        if not src:
            return
        if len(src) != len(dst):
            raise IndexError(f"KV rows {src} -> {dst}: not as many sources as destinations")
        s, d = self._host_rows(slot, src), self._host_rows(slot, dst)
        self.k_rows[:, d] = self.k_rows[:, s]
        self.v_rows[:, d] = self.v_rows[:, s]

    def get_rows(self, slot: int, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions `rows` of every layer: (layers, len(rows), G, D) copies."""
        idx = self._host_rows(slot, rows)
        return self.k_rows[:, idx], self.v_rows[:, idx]

    def set_rows(self, slot: int, rows: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        idx = self._host_rows(slot, rows)
        self.k_rows[:, idx] = k
        self.v_rows[:, idx] = v

    def snapshot_rows(self) -> dict[str, PagedRows]:
        """The cache's K and V as the prefix cache's position-indexed tensors."""
        return {"k": PagedRows(self, self.k_rows), "v": PagedRows(self, self.v_rows)}


class PagedRows:
    """One of a paged cache's tensors as `shards.snapshots.SnapshotStore` reads and writes it:
    rows [start, end) of a slot, every layer at once, through the slot's block table."""

    def __init__(self, cache: PagedKVCache, rows: torch.Tensor) -> None:
        self.cache, self.rows = cache, rows  # rows: (layers, pool rows, G, D)
        self.layers, self.slots, self.max_len = rows.shape[0], cache.slots, cache.max_len
        self.device, self.dtype = rows.device, rows.dtype

    def index(self, slot: int, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.cache.capacity(slot):
            raise ValueError(f"rows {start}:{end} of slot {slot} outside its block table of "
                             f"{self.cache.capacity(slot)} rows")
        return self.cache.flat_rows(slot, torch.arange(start, end, device=self.device))

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """(layers, end - start, G, D), a copy."""
        return self.rows[:, self.index(slot, start, end)]

    def layer_shape(self, start: int, end: int) -> tuple[int, ...]:
        return (end - start, *self.rows.shape[2:])

    def write(self, slot: int, start: int, end: int, src: torch.Tensor,
              layer: int | None = None) -> None:
        """Rows [start, end) of every layer (src: (layers, n, ...)) or of one (src: (n, ...))."""
        idx = self.index(slot, start, end)
        if layer is None:
            self.rows[:, idx] = src.to(self.device, non_blocking=True)
        else:
            self.rows[layer, idx] = src.to(self.device, non_blocking=True)

    def view(self, layer: int, slot: int, start: int, end: int) -> None:
        """No contiguous view of a slot's rows exists (see `TensorRows.view`)."""
        return


class HostKVPool:
    """The shard's host-memory tier of live KV (`runtime.batching`, swap preemption): up to
    `num_blocks` blocks shaped like the device pool's, in plain (pageable) host memory. Block
    ids are the coordinator's (its host BlockManager), the same on every shard.
    Memory is taken when blocks are swapped out and given back when they are swapped in or
    dropped, so the shard holds only what the coordinator's ledger of its host memory counts
    (`runtime.host_pool`: the prefix cache's RAM-tier snapshots share that memory).
    Copies are synchronous: a swap-out is done before its device blocks can be reused, a
    swap-in before any step reads them (the handler replies only then).

    Not pinned: torch's caching host allocator rounds a pinned request up to a power of two and
    keeps a freed buffer for a request of the same size class, never giving it back, so the
    pinned memory of swaps of varied sizes would grow past the ledger's count. Pageable copies
    are slower (not measured here); a pool of fixed-size pinned blocks would be the next step."""

    def __init__(self, kv: PagedKVCache, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"host KV pool: {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.kv = kv
        # host block -> its K and V rows, each (layers, block, kv_heads, head_dim): views of
        # the buffer of the swap-out that filled it (freed once all its blocks are gone)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes the blocks held now take."""
        return sum(2 * k.numel() * k.element_size() for k, _ in self.held.values())

    def pairs_error(self, kv: PagedKVCache, pairs: Any, direction: str = "out") -> str | None:
        """Why `pairs` is not a list of [device block, host block] pairs of this pool and
        `kv`'s (each id in range, no device or host block twice; "in" names only blocks the
        pool holds; "drop" no device block, -1, and any host block: one that holds nothing
        stays so, as after a swap-out that failed on this shard), or None."""
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and
                all(isinstance(b, int) and not isinstance(b, bool) for b in p) for p in pairs):
            return f"pairs must be a list of [device block, host block], got {str(pairs)[:120]}"
        low = -1 if direction == "drop" else 0
        high = 0 if direction == "drop" else kv.num_blocks
        bad = next((p for p in pairs if not (low <= p[0] < high and
                                             0 <= p[1] < self.num_blocks)), None)
        if bad is not None:
            if direction == "drop":
                return f"drop pair {bad} is not [-1, host block 0..{self.num_blocks - 1}]"
            return (f"pair {bad} outside device blocks 0..{kv.num_blocks - 1} or host blocks "
                    f"0..{self.num_blocks - 1}")
        if direction != "drop" and len({p[0] for p in pairs}) != len(pairs):
            return "pairs list a device block twice"
        if len({p[1] for p in pairs}) != len(pairs):
            return "pairs list a host block twice"
        empty = next((p[1] for p in pairs if p[1] not in self.held), None)
        if direction == "in" and empty is not None:
            return f"host block {empty} holds nothing"
        return None

    def swap_out(self, kv: PagedKVCache, pairs: Sequence[Sequence[int]]) -> None:
        """Device block d -> host block h, every layer, for each [d, h] (checked first)."""
        if not pairs:
            return
        dev, host = _settled_ids(kv, pairs)
        shape = (kv.k_store.shape[0], len(pairs), *kv.k_store.shape[2:])
        k = torch.empty(shape, dtype=kv.k_store.dtype)
        v = torch.empty(shape, dtype=kv.v_store.dtype)
        k.copy_(kv.k_store[:, dev])
        v.copy_(kv.v_store[:, dev])
        for i, h in enumerate(host.tolist()):
            self.held[h] = (k[:, i], v[:, i])

    def swap_in(self, kv: PagedKVCache, pairs: Sequence[Sequence[int]]) -> None:
        """Host block h -> device block d, every layer, for each [d, h] (checked first); the
        host blocks are free then."""
        if not pairs:
            return
        dev, host = _settled_ids(kv, pairs)
        hosts = host.tolist()
        kv.k_store[:, dev] = torch.stack([self.held[h][0] for h in hosts], 1).to(kv.device)
        kv.v_store[:, dev] = torch.stack([self.held[h][1] for h in hosts], 1).to(kv.device)
        _settle(kv)  # (in place before the handler replies: the next step reads the rows)
        self.drop(hosts)

    def drop(self, hosts: Sequence[int]) -> None:
        """The host blocks' memory is given back (their sequence ended while swapped out)."""
        for h in hosts:
            self.held.pop(h, None)


def _settled_ids(kv: PagedKVCache, pairs: Sequence[Sequence[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The device block ids (on the pool's device) and host block ids of `pairs`, once the
    pool's GPU has settled (`_settle`)."""
    _settle(kv)
    return (torch.tensor([p[0] for p in pairs], dtype=torch.long, device=kv.device),
            torch.tensor([p[1] for p in pairs], dtype=torch.long))


def _settle(kv: PagedKVCache) -> None:
    """Every kernel queued on the pool's GPU is done (no-op on CPU): a swap never races a
    step's kernels or another stream's copies."""
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)
