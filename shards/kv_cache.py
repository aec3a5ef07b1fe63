"""Static KV cache of one layer range: allocated once, token-major so a prefix is contiguous.

Layout per tensor: (layers, slots, max_len, kv_heads, head_dim). Rows [0, P) of one layer and
slot are one contiguous block, so a snapshot or a disk write of a prefix is a single copy.

Each slot has one more row, at index max_len, that nothing reads: the scratch row. A batched
decode step (`StepInfo.batched`) pads its batch with rows of slots not in it and writes their
K/V there, so a padding row never changes a live one. `k` and `v` are views of the usable rows
[0, max_len) of the storage `k_store` and `v_store` (max_len + 1 rows per slot), so whoever
reads or snapshots `k` and `v` never sees the scratch row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from layersplit.shards.device import to_device

if TYPE_CHECKING:
    from layersplit.shards.layers.step import StepInfo


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        max_len: int,
        slots: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout, self.max_len, self.slots = layout, max_len, slots
        shape = (layout.layers, slots, max_len + 1, layout.kv_heads, layout.head_dim)
        self.k_store = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v_store = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.k, self.v = self.k_store[:, :, :max_len], self.v_store[:, :, :max_len]

    @property
    def nbytes(self) -> int:
        """Bytes allocated, scratch rows included."""
        return 2 * self.k_store.numel() * self.k_store.element_size()

    def append(
        self, layer: int, slot: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's rows and return views of the rows it attends, [0, step.kv_len)."""
        if step.kv_len > self.max_len:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        if step.pos is not None:
            end = step.pos + k.shape[0]
            self.k[layer, slot, step.pos:end] = k
            self.v[layer, slot, step.pos:end] = v
        else:  # position known only on the device (a captured graph)
            rows = step.positions if step.rows is None else step.rows
            self.k[layer, slot].index_copy_(0, rows, k)
            self.v[layer, slot].index_copy_(0, rows, v)
        return self.k[layer, slot, :step.kv_len], self.v[layer, slot, :step.kv_len]

    def append_batch(
        self, layer: int, step: StepInfo, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store row b of a batched step at position `step.positions[b]` of slot `step.lo + b`
        (the scratch row for a padding row) and return views of the rows the step attends:
        rows [0, step.kv_len) of slots [lo, lo + B), each (B, kv_len, kv_heads, head_dim)."""
        if step.kv_len > self.max_len:
            raise IndexError(f"KV cache holds {self.max_len} tokens; step needs {step.kv_len}")
        where = (step.slots, step.positions)  # device tensors: no host sync, graph-safe
        self.k_store[layer].index_put_(where, k)
        self.v_store[layer].index_put_(where, v)
        lo, hi = step.lo, step.lo + k.shape[0]
        return self.k[layer, lo:hi, :step.kv_len], self.v[layer, lo:hi, :step.kv_len]

    def move_rows(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy rows `src` of every layer of `slot` to rows `dst` (the kept path of a tree
        verify step, `shards.spec_tree.kept_moves`)."""
        self.move_rows_many([(slot, src, dst)])

    def move_rows_many(self, moves: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
        """`move_rows` of several slots, (slot, src, dst) each, as one gather and one scatter
        per tensor (a batched step's sequences: one copy, not one per sequence). Every source
        row is read before any is written, as the moves of `kept_moves` in their order read."""
        slots, src, dst = [], [], []
        for slot, s, d in moves:
            if len(s) != len(d):
                raise IndexError(f"KV rows {list(s)} -> {list(d)} of slot {slot}: not as many "
                                 "sources as destinations")
            if not all(0 <= r < self.max_len for r in (*s, *d)) or not 0 <= slot < self.slots:
                raise IndexError(f"KV rows {list(s)} -> {list(d)} of slot {slot} outside the "
                                 f"cache's {self.slots} slots of {self.max_len} rows")
            slots += [slot] * len(s)
            src += s
            dst += d
        if not src:
            return
        n = len(src)
        idx = to_device([*slots, *src, *dst], self.k.device)
        sl, s_idx, d_idx = idx[:n], idx[n:2 * n], idx[2 * n:]
        k, v = self.k[:, sl, s_idx], self.v[:, sl, s_idx]  # (both read first: a failure to
        self.k[:, sl, d_idx] = k  # allocate them leaves every row where it was)
        self.v[:, sl, d_idx] = v

    @property
    def scratch_pos(self) -> int:
        """A position whose row is the scratch row (a batched step's padding rows)."""
        return self.max_len

    def get_rows(self, slot: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions `rows` of every layer: (layers, len(rows), G, D) copies."""
        return self.k[:, slot, rows].clone(), self.v[:, slot, rows].clone()

    def set_rows(self, slot: int, rows: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, slot, rows] = k
        self.v[:, slot, rows] = v

    def snapshot_rows(self) -> dict[str, torch.Tensor]:
        """The cache's K and V as the prefix cache's position-indexed tensors."""
        return {"k": self.k, "v": self.v}

    def rows(self, layer: int, slot: int, start: int,
             end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V rows [start, end) of one layer: each (end - start, kv_heads,
        head_dim)."""
        return self.k[layer, slot, start:end], self.v[layer, slot, start:end]
