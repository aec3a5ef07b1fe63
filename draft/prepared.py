"""Proposals the draft computes before the coordinator asks for them.

With a verify step's verdict, the last shard tells the draft which proposal the sequence will
ask for next (`verdict`'s `next`: position, the target's token, the tree rows kept, n, tree). The
draft computes it as soon as every feeding shard has delivered that step's rows, while the
verdict travels to the coordinator and the coordinator's request travels back; the request then
finds it ready. A request that asks for anything else is computed as always: a prepared
proposal is a cache, never a second source of truth.

Its subtleties: preparing a proposal moved the kept rows' features into place already, so the
request that names the same kept rows must not move them again (`take`); and the verdict comes
after its step's rows (and, asking, after the result), so a request may be served before it
comes: the request moved the rows then, and the late verdict is dropped (`note`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from layersplit.shards.spec_tree import check_path

Key = tuple[int, int, int, int, tuple[int, ...] | None]  # pos, token, n, tree, kept
Proposal = tuple[list[int], list[int] | None, list | None]  # tokens, parents, q


def check_next(nxt: Any) -> Key:
    """The key of a `next` hint; ValueError naming what is wrong."""
    if not isinstance(nxt, dict):
        raise ValueError(f"next={nxt!r}: not a map")
    vals = [nxt.get(k) for k in ("pos", "token", "n", "tree")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise ValueError(f"next={nxt!r}: pos, token, n and tree must be integers >= 0")
    kept = nxt.get("kept")
    if kept is not None and not (isinstance(kept, list) and all(
            isinstance(j, int) and not isinstance(j, bool) for j in kept)):
        raise ValueError(f"next={nxt!r}: kept must be a list of row numbers or null")
    if kept is not None:
        check_path(kept, vals[0])
    return (*vals, None if kept is None else tuple(kept))


def key_of(pos: int, token: int, n: int, tree: int, kept: Sequence[int] | None) -> Key:
    return pos, token, n, tree, None if kept is None else tuple(kept)


@dataclasses.dataclass
class Prepared:
    """Per draft context (slot): a proposal waiting for its step's rows, or one computed."""

    pending: dict[int, tuple[int, Key, bool]] = dataclasses.field(default_factory=dict)
    ready: dict[int, tuple[Key, Proposal, float]] = dataclasses.field(default_factory=dict)
    # when (time.monotonic, one clock for every process of the host) the last verdict came and
    # its proposal was ready, per slot: how far ahead of the request it was (metrics)
    times: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # the (pos, kept) whose kept rows a preparation moved already, per slot (a preparation
    # that fails after moving them must not have them moved again)
    moved: dict[int, tuple[int, tuple[int, ...] | None]] = dataclasses.field(
        default_factory=dict)
    # the last step whose rows a request served needed (its `sync`), per slot
    served: dict[int, int] = dataclasses.field(default_factory=dict)

    def note(self, slot: int, sid: int, key: Key, push: bool = False) -> None:
        """Step `sid`'s verdict names the next proposal of `slot`'s sequence (`push`: it goes
        to the first shard, which holds that step for it); dropped when a request that needed
        that step's rows was served already (it computed the proposal itself)."""
        if sid <= self.served.get(slot, -1):
            return
        self.pending[slot] = (sid, key, push)
        self.ready.pop(slot, None)
        self.times[slot] = (time.monotonic(), 0.0)

    def forget(self, slot: int | None = None) -> None:
        """A new sequence in `slot` (None: every slot)."""
        if slot is None:
            self.pending.clear()
            self.ready.clear()
            self.moved.clear()
            self.served.clear()
        else:
            self.pending.pop(slot, None)
            self.ready.pop(slot, None)
            self.moved.pop(slot, None)
            self.served.pop(slot, None)

    def due(self, fed_sids: Sequence[int]) -> list[tuple[int, int, Key, bool]]:
        """The pending proposals whose rows every feeder delivered (removed from pending):
        (slot, the sid of the verdict's step, key, push)."""
        out = [(slot, sid, key, push) for slot, (sid, key, push) in self.pending.items()
               if all(f >= sid for f in fed_sids)]
        for slot, *_ in out:
            del self.pending[slot]
        return out

    def committed(self, slot: int, key: Key) -> None:
        """A preparation moved the kept rows of `key`'s verdict."""
        self.moved[slot] = (key[0], key[4])

    def done(self, slot: int, key: Key, proposal: Proposal, seconds: float) -> None:
        self.ready[slot] = (key, proposal, seconds)
        self.times[slot] = (self.times.get(slot, (0.0, 0.0))[0], time.monotonic())

    def take(self, slot: int, key: Key, sync: int) -> tuple[tuple[Proposal, float] | None, bool]:
        """For a request of `slot` with `key`, which needed the rows of step `sync`: (the
        prepared proposal and its compute time, or None), and whether the request's kept rows
        still need moving."""
        self.served[slot] = max(self.served.get(slot, -1), sync)
        self.pending.pop(slot, None)  # asked for now: computed by the request itself
        moved = self.moved.pop(slot, None) == (key[0], key[4])  # this verdict's kept rows
        got = self.ready.pop(slot, None)
        if got is not None and got[0] == key:
            return (got[1], got[2]), False
        return None, not moved
