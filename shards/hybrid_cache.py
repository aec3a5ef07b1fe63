"""Per-slot state of a hybrid layer range: the KV cache of its full-attention layers and the conv
and recurrent state of its linear-attention (Gated DeltaNet) layers.

`HybridCache` is a `KVCache` (`PagedHybridCache` a `PagedKVCache`, in a shard) over the range's
attention layers (index = the attention layer's rank within the range), plus
- `conv`:  (linear layers, slots + 1, conv_dim, K - 1), in the model dtype;
- `state`: (linear layers, slots + 1, Hv, Dk, Dv), float32 always (it accumulates over the whole
  sequence);
indexed by the linear layer's rank within the range; slot `slots` is scratch (`scratch_slot`:
a batched step's padding rows advance it, not a sequence's). A KV row can be rewritten at will (a
position's row depends only on that position's token); a recurrent state cannot: it is the
state after exactly the tokens consumed so far. So:
- a step at position 0 starts from zeros (`reset`);
- a speculative verify step keeps the state after each of its rows (`keep_rows`), and the
  sequence's next step, whose position says how many rows were kept (`settle`), picks the
  state of the last kept row.
"""

from __future__ import annotations

import torch
from layersplit.shards.kv_cache import KVCache, KVLayout
from layersplit.shards.paged_kv import PagedKVCache


class HybridState:
    """The conv and recurrent states of a hybrid range's linear-attention layers, per slot
    (mixed into a KV cache class: `HybridCache`, `PagedHybridCache`)."""

    slots: int

    def _init_state(self, layout: KVLayout, device: torch.device | str, linear_layers: int,
                    conv_shape: tuple[int, int], state_shape: tuple[int, int, int]) -> None:
        slots = self.slots + 1  # (and the scratch slot, `scratch_slot`)
        self.conv = torch.zeros((linear_layers, slots, *conv_shape), dtype=layout.dtype,
                                device=device)
        self.state = torch.zeros((linear_layers, slots, *state_shape), dtype=torch.float32,
                                 device=device)
        # slot -> (position of its last verify step, [(conv, state) after each row])
        self.pending: dict[int, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    @property
    def scratch_slot(self) -> int:
        """The states a batched step's padding rows read and write (no sequence's)."""
        return self.slots

    @property
    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state))

    def reset(self, slot: int) -> None:
        """The state of an empty prefix."""
        self.conv[:, slot].zero_()
        self.state[:, slot].zero_()
        self.pending.pop(slot, None)

    def forget(self, slot: int) -> None:
        """The slot's state was just restored from the prefix cache: no verify rows pend."""
        self.pending.pop(slot, None)

    def save(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[:, slot].clone(), self.state[:, slot].clone()

    def load(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv[:, slot].copy_(saved[0])
        self.state[:, slot].copy_(saved[1])

    def gather_states(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of linear layer `layer`'s conv and recurrent states of `slots` ((B,) long on
        the device: graph-safe), (B, C, K - 1) and (B, Hv, Dk, Dv)."""
        return self.conv[layer].index_select(0, slots), self.state[layer].index_select(0, slots)

    def scatter_states(self, layer: int, slots: torch.Tensor, conv: torch.Tensor,
                state: torch.Tensor) -> None:
        """`gather_states`'s states, advanced, written back to `slots`."""
        self.conv[layer].index_copy_(0, slots, conv)
        self.state[layer].index_copy_(0, slots, state)

    def keep_pair(self, slot: int, pos: int, keep: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`keep_rows` of a verify step's (conv, state) after each row, (layers, n, ...) each
        (`HybridRange.new_keep`): row j's are views of them."""
        conv, state = keep
        self.keep_rows(slot, pos, [(conv[:, j], state[:, j]) for j in range(conv.shape[1])])

    def keep_rows(self, slot: int, pos: int,
                  rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A verify step at `pos` left the state after each of its rows (`rows`, row 0 = the
        last committed token); the live state stays undecided until `settle`."""
        self.pending[slot] = (pos, rows)

    def own_kept_rows(self, shared: torch.Tensor, slot: int) -> None:
        """Before a step writes the shared buffer `shared` (a verify graph's kept states,
        `StaticDecoder.keep_buffers`): another slot's pending rows that are views of it are
        copied out first, so that slot settles on its own rows (`slot`'s own are replaced)."""
        ptr = shared.untyped_storage().data_ptr()
        for other, (at, rows) in list(self.pending.items()):
            if other != slot and rows and rows[0][1].untyped_storage().data_ptr() == ptr:
                self.pending[other] = (at, [(c.clone(), s.clone()) for c, s in rows])

    def settle(self, slot: int, pos: int, kept: list[int] | None) -> None:
        """Before a step at `pos` of `slot`: if the slot's last step was a verify step, take
        the state of the last row it kept. `kept`: the kept rows of a tree (None: rows
        1 .. pos - verify_pos - 1, a chain's or a tree's first branch)."""
        got = self.pending.pop(slot, None)
        if got is None or pos == 0:  # (a new sequence in the slot starts from zeros)
            return
        at, rows = got
        accepted = pos - at - 1
        if not 0 <= accepted < len(rows):
            raise ValueError(f"a step at {pos} after a verify step of {len(rows)} rows at {at}")
        last = kept[-1] if kept else accepted
        self.load(slot, rows[last])


class HybridCache(HybridState, KVCache):
    def __init__(self, layout: KVLayout, max_len: int, slots: int, device: torch.device | str,
                 linear_layers: int, conv_shape: tuple[int, int],
                 state_shape: tuple[int, int, int]) -> None:
        KVCache.__init__(self, layout, max_len, slots, device)
        self._init_state(layout, device, linear_layers, conv_shape, state_shape)

    @property
    def nbytes(self) -> int:
        return KVCache.nbytes.fget(self) + self.state_nbytes


class PagedHybridCache(HybridState, PagedKVCache):
    def __init__(self, layout: KVLayout, max_len: int, slots: int, num_blocks: int, block: int,
                 device: torch.device | str, linear_layers: int, conv_shape: tuple[int, int],
                 state_shape: tuple[int, int, int]) -> None:
        PagedKVCache.__init__(self, layout, max_len, slots, num_blocks, block, device)
        self._init_state(layout, device, linear_layers, conv_shape, state_shape)

    @property
    def nbytes(self) -> int:
        return PagedKVCache.nbytes.fget(self) + self.state_nbytes
