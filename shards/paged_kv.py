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
from typing import TYPE_CHECKING

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
        # each layer's rows, viewed once: an eager step's layers index them without a select op
        self.k_layers, self.v_layers = self.k_rows.unbind(0), self.v_rows.unbind(0)
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
        """`_pool_rows` on the device."""
        return to_device(self._pool_rows(slot, rows), self.k_store.device)

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
        k_rows, v_rows, write = self.step_pool(layer, slot, step)
        k_rows.index_copy_(0, write, k)
        v_rows.index_copy_(0, write, v)
        return self.gather(layer, slot, step, k, v)

    def step_pool(self, layer: int, slot: int, step: StepInfo
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where one sequence's step stores its K/V rows: the layer's K and V rows (pool
        rows, G, D) and the pool row of each of the step's rows (n,). A kernel that stores
        them itself (`row_ops.rope_qk`) takes these; `gather` then reads the step's keys."""
        if step.kv_len > self.scratch_pos:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        write, _ = self._step_index(slot, step)
        return self.k_layers[layer], self.v_layers[layer], write

    def gather(self, layer: int, slot: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows [0, step.kv_len) a step attends, gathered, once its own rows `k`, `v` are
        stored (`append`, or a kernel through `step_pool`): (kv_len, kv_heads, head_dim)."""
        _, read = self._step_index(slot, step)
        if k.is_cuda and step.pos == 0 and step.kv_len == k.shape[0]:
            return k, v  # a first chunk attends only its own rows: no gather (the same values)
        return (self.k_layers[layer].index_select(0, read),
                self.v_layers[layer].index_select(0, read))

    def append_batch(
        self, layer: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store row b of a batched step at position `step.positions[b]` of slot
        `step.slots[b]` (the scratch block for a padding row) and return the rows each attends,
        [0, kv_len) of its own slot, gathered: (B, kv_len, kv_heads, head_dim) each. A batched
        verify step (`StepInfo.batched_tree`) writes row b at `step.rows[b]` of its sequence
        (b // n), whose table is `step.tables[b // n]`, and returns each sequence's rows once:
        (S, kv_len, kv_heads, head_dim)."""
        write, read = self._batch_index(step)
        self.k_rows[layer].index_copy_(0, write, k)
        self.v_rows[layer].index_copy_(0, write, v)
        shape = (*read.shape, *k.shape[1:])
        return (self.k_rows[layer].index_select(0, read.reshape(-1)).view(shape),
                self.v_rows[layer].index_select(0, read.reshape(-1)).view(shape))

    def _batch_index(self, step: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows written (n,), rows read (S, kv_len)) of a batched step, as pool indices; once
        per step."""
        if step.kv_len > self.scratch_pos:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        got = step.paged.get("batch")
        if got is None:
            b, dev = self.block, self.k_store.device
            tables = self.table[step.slots] if step.tables is None else step.tables  # (S, W)
            pos = step.positions if step.rows is None else step.rows
            rows_tables = tables.repeat_interleave(step.seq_rows, dim=0) \
                if step.seq_rows > 1 else tables  # each sequence's table for each of its rows
            write = rows_tables.gather(1, (pos // b)[:, None])[:, 0] * b + pos % b
            keys = torch.arange(step.kv_len, device=dev)
            read = tables[:, keys // b] * b + keys % b  # (S, kv_len)
            got = step.paged["batch"] = (write, read)
        return got

    def pool_index(self, layer: int, slot: int, step: StepInfo
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a kernel that writes the step's rows and reads the pool in place takes: the
        layer's pool of K and V rows (pool rows, G, D) each, the pool row each step row writes
        (n,) and the pool index of each key each sequence attends, (S, kv_len) (S = 1 but for
        a batched step). Writes nothing."""
        if step.lo is not None:
            write, read = self._batch_index(step)
        else:
            if step.kv_len > self.scratch_pos:
                raise IndexError(f"KV cache holds {self.max_len} tokens; step needs "
                                 f"{step.kv_len}")
            write, read = self._step_index(slot, step)
            read = read[None]
        return self.k_rows[layer], self.v_rows[layer], write, read

    # ---- rows ---------------------------------------------------------------------------------
    def move_rows(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy rows `src` of every layer of `slot` to rows `dst` (a tree verify's kept path)."""
        self.move_rows_many([(slot, src, dst)])

    def move_rows_many(self, moves: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
        """`move_rows` of several slots, (slot, src, dst) each: their pool indices computed
        from the host's copy of the tables, then one gather and one scatter per tensor for all
        of them. Every source row is read before any is written, as the moves of `kept_moves`
        in their order read."""
        src, dst = [], []
        for slot, s, d in moves:
            if len(s) != len(d):
                raise IndexError(f"KV rows {list(s)} -> {list(d)} of slot {slot}: not as many "
                                 "sources as destinations")
            src += self._pool_rows(slot, s)
            dst += self._pool_rows(slot, d)
        if not src:
            return
        idx = to_device(src + dst, self.k_store.device)
        s_idx, d_idx = idx[:len(src)], idx[len(src):]
        k, v = self.k_rows[:, s_idx], self.v_rows[:, s_idx]  # (both read before any write: a
        self.k_rows[:, d_idx] = k  # failure to allocate them leaves every row where it was)
        self.v_rows[:, d_idx] = v

    def _pool_rows(self, slot: int, rows: Sequence[int]) -> list[int]:
        """Indices into the flattened pool of positions `rows` of `slot`, on the host."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside 0..{self.slots - 1}")
        table, b = self.tables[slot], self.block
        if rows and not 0 <= min(rows) <= max(rows) < len(table) * b:
            raise IndexError(f"KV rows {min(rows)}..{max(rows)} of slot {slot} outside its block "
                             f"table of {len(table) * b} rows")
        return [table[r // b] * b + r % b for r in rows]

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

    read_copies = True  # `read` gathers the rows into a tensor of their own

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
