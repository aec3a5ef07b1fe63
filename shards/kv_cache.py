"""Static KV cache of one layer range: allocated once, token-major so a prefix is contiguous.

Layout per tensor: (layers, slots, max_len, kv_heads, head_dim). Rows [0, P) of one layer and
slot are one contiguous block, so a snapshot or a disk write of a prefix is a single copy.
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shards.model import StepInfo


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
        shape = (layout.layers, slots, max_len, layout.kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

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
            self.k[layer, slot].index_copy_(0, step.positions, k)
            self.v[layer, slot].index_copy_(0, step.positions, v)
        return self.k[layer, slot, :step.kv_len], self.v[layer, slot, :step.kv_len]

    def rows(self, layer: int, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of K and V rows [start, end) of one layer: each (end - start, kv_heads, head_dim)."""
        return self.k[layer, slot, start:end], self.v[layer, slot, start:end]
