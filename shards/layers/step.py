"""Where a step's tokens go and which keys they attend: `StepInfo`, shared by every layer of a
step. Shapes: n = tokens in this step, T = keys attended."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from layersplit.shards.device import host_to_device, to_device
from layersplit.shards.spec_tree import ancestors, depths


class SegmentsRefused(RuntimeError):
    """A layer that cannot take a `StepInfo.segments` step (its caller runs each part alone)."""


@dataclasses.dataclass(slots=True)
class StepInfo:
    """Where a step's n tokens go and which keys they attend.

    Eager steps (`eager`) write KV rows by slice and attend exactly pos + n keys. Static steps
    (`static`, for CUDA-graph capture) take the position from a device tensor, write rows with
    `index_copy_` and attend a fixed `kv_len` keys under a mask, so one captured graph serves
    every position up to `kv_len`. Batched steps (`batched`, continuous batching) are static
    decode steps of several sequences at once: row b is one token of the sequence in slot lo + b.
    """

    positions: torch.Tensor  # (n,) long, on the model's device
    kv_len: int  # key rows attended
    mask: torch.Tensor | None  # (n, kv_len) bool, True = attend; None = all (eager decode)
    pos: int | None  # first position, when known on the host (eager)
    grouped: bool = False  # attend with query heads grouped per KV head (static decode)
    lo: int | None = None  # batched step: the slot of row 0
    slots: torch.Tensor | None = None  # batched step: (n,) long, the slot of each row
    rows: torch.Tensor | None = None  # static step: (n,) KV rows written, when not `positions`
    windowed: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # a paged cache's pool indices of the rows each slot writes and reads (`shards.paged_kv`),
    # computed by the step's first layer for all of them
    paged: dict = dataclasses.field(default_factory=dict)
    # a captured step over a paged cache: (S, W) long, the block table of each of its S
    # sequences (a graph input, so one graph serves any slot); None: the cache's own tables
    tables: torch.Tensor | None = None
    # `mask` is plain causal over [0, pos + n) keys, the queries the last n (an eager step's)
    causal: bool = False
    # a batched step: rows per sequence (1: a decode row each; more: `batched_tree`)
    seq_rows: int = 1
    # eager steps of several sequences as one (`segments`): (slot, its own eager step, first
    # row, end row) each; attention and the KV rows go part by part, the rest over all rows
    parts: list[tuple[int, StepInfo, int, int]] | None = None
    # a hybrid range's batched step: (n,) long on the device, the slot whose conv and recurrent
    # states row b reads and advances (a padding row's: the cache's scratch slot)
    states: torch.Tensor | None = None

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that sees only keys within `window` positions of each query
        (transformers' sliding window: key k is seen by query q iff q - window < k <= q), or
        the step's own mask for full attention. Computed once per step and window.

        A key's position is its KV row, except the rows a tree verify step writes: row
        pos + j holds the token at position pos + depth(j), so those rows take the step's
        positions (a deep tree in a short window still sees the right ancestors)."""
        if window is None or (self.pos is not None and self.kv_len <= window):
            return self.mask  # no query can be `window` positions past key 0
        if self.seq_rows > 1:  # (its tree rows' key positions are not computed here)
            raise ValueError("a batched verify step runs no sliding-window layer")
        m = self.windowed.get(window)
        if m is None:
            dev = self.positions.device
            key_pos = torch.arange(self.kv_len, device=dev)
            if self.lo is None:  # a single sequence: its written rows may be a tree's
                n = self.positions.shape[0]
                rows = (self.rows if self.rows is not None else
                        torch.arange(self.pos, self.pos + n, device=dev)
                        if self.pos is not None else self.positions)
                key_pos = key_pos.index_copy(0, rows, self.positions)
            near = key_pos[None, :] > self.positions[:, None] - window
            m = near if self.mask is None else self.mask & near
            self.windowed[window] = m
        return m

    @staticmethod
    def eager(pos: int, n: int, device: torch.device) -> StepInfo:
        positions = torch.arange(pos, pos + n, device=device)
        mask = None
        if n > 1:
            mask = torch.arange(pos + n, device=device)[None, :] <= positions[:, None]
        return StepInfo(positions, pos + n, mask, pos, causal=True)

    @staticmethod
    def segments(parts: Sequence[tuple[int, int, int]], device: torch.device) -> StepInfo:
        """Eager steps of several sequences, (slot, pos, n) each, their rows one after the
        other, as one step: only a layer that attends part by part (`FusedDecode.prefill`)
        takes it; each part is the eager step of its sequence alone."""
        steps, a = [], 0
        for slot, pos, n in parts:
            steps.append((slot, StepInfo.eager(pos, n, device), a, a + n))
            a += n
        positions = torch.cat([p[1].positions for p in steps])
        return StepInfo(positions, max(p[1].kv_len for p in steps), None, None, parts=steps)

    @staticmethod
    def static(pos: torch.Tensor, n: int, kv_len: int) -> StepInfo:
        """`pos`: a (1,) long device tensor holding the first position (graph input)."""
        positions = pos + torch.arange(n, device=pos.device)
        mask = torch.arange(kv_len, device=pos.device)[None, :] <= positions[:, None]
        return StepInfo(positions, kv_len, mask, None, grouped=True)

    @staticmethod
    def tree(pos: int, parents: Sequence[int], device: torch.device) -> StepInfo:
        """An eager verify step over a token tree (`shards.spec_tree`): row j at position
        pos + depth(j), its K/V written at row pos + j, attending [0, pos) and its ancestors."""
        anc = ancestors(parents)
        n = anc.shape[0]
        # (through pinned memory: a pageable copy would make the host wait for the stream)
        mask = host_to_device(torch.cat([torch.ones(n, pos, dtype=torch.bool), anc], dim=1),
                              device)
        positions = pos + to_device(depths(parents), device)
        return StepInfo(positions, pos + n, mask, pos)

    @staticmethod
    def static_tree(pos: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                    kv_len: int) -> StepInfo:
        """`tree` for a captured graph: `pos` (1,), `depth` (n,) and `anc` (n, n) bool are
        device tensors (graph inputs), so one graph serves every tree of n rows. A chain's
        depth and ancestors make it `static`'s verify step."""
        n = depth.shape[0]
        dev = pos.device
        keys = torch.arange(kv_len, device=dev)
        rel = keys - pos
        in_tree = (rel >= 0) & (rel < n)
        mask = (keys < pos)[None, :] | (anc[:, rel.clamp(0, n - 1)] & in_tree[None, :])
        rows = pos + torch.arange(n, device=dev)
        return StepInfo(pos + depth, kv_len, mask, None, grouped=True, rows=rows)

    @staticmethod
    def batched(positions: torch.Tensor, lo: int, kv_len: int,
                slots: torch.Tensor | None = None) -> StepInfo:
        """One decode row per slot of [lo, lo + B): row b at position `positions[b]` of slot
        lo + b, attending that slot's keys [0, kv_len). `positions`: (B,) long on the device (a
        graph input); a padding row's position is the cache's scratch row (`KVCache.max_len`),
        which no real row attends. `slots`: (B,) long on the device, the slot of each row, for
        a paged cache (any slots; a graph input), else slots [lo, lo + B)."""
        dev = positions.device
        mask = torch.arange(kv_len, device=dev)[None, :] <= positions[:, None]
        if slots is None:
            slots = lo + torch.arange(positions.shape[0], device=dev)
        return StepInfo(positions, kv_len, mask, None, grouped=True, lo=lo, slots=slots)

    @staticmethod
    def batched_tree(rows: torch.Tensor, positions: torch.Tensor, anc: torch.Tensor,
                     kv_len: int, tables: torch.Tensor) -> StepInfo:
        """The verify steps of S sequences as one step over a paged cache (`static_tree` for
        each, side by side): sequence s's n rows write its KV rows `rows[s]` (pos_s + j; a
        padding sequence's are the cache's scratch position, which no real row attends), are
        at `positions[s]` (pos_s + depth(j)), and row j attends the sequence's keys
        [0, pos_s) and its ancestors `anc[s, j]` among the step's rows. `rows`, `positions`
        (S, n) long, `anc` (S, n, n) bool and `tables` (S, W), each sequence's block table,
        are device tensors (graph inputs). Row s * n + j of the step is row j of sequence s."""
        s, n = rows.shape
        dev = rows.device
        rel = torch.arange(kv_len, device=dev)[None, :] - rows[:, :1]  # (S, T): key - pos_s
        in_tree = (rel >= 0) & (rel < n)
        seen = anc.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(s, n, kv_len))
        mask = (rel < 0)[:, None, :] | (seen & in_tree[:, None, :])  # (S, n, T)
        return StepInfo(positions.reshape(-1), kv_len, mask.reshape(s * n, kv_len), None,
                        grouped=True, lo=0, rows=rows.reshape(-1), tables=tables, seq_rows=n)
