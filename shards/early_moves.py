"""The last shard's early moves of a token tree's kept rows.

After a tree verify step, the rows of the kept path must move to the positions their tokens now
hold (`shards.spec_tree.kept_moves`) before the sequence's next step; that step carries them
(`kept`), and every shard moves them when it comes. The last shard chose them: it moves its own
right after sending the step's result, while the draft computes the next proposal, so the move
is off the round's path. The next step, carrying the same (pos, kept), then moves nothing there.

The moves are not idempotent (row 3 onto row 2 after row 2 onto row 1), so each is made exactly
once: a step whose (pos, kept) matches an early move skips it, and a failed early move (rows
possibly half moved) fails the sequence's next step by name instead of moving them again. Only
committed tokens' rows move. Hybrid models are left out: their recurrent state of the last kept
row settles with the next step (`RangeExecutor.before_steps`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from layersplit.shards.hybrid_cache import HybridState
from layersplit.shards.spec_tree import rows_to_move

if TYPE_CHECKING:
    from layersplit.shards.executor import RangeExecutor

log = logging.getLogger("layersplit.shard")

Move = tuple[int, int, list[int] | None]  # (slot, the next step's pos, kept rows)


@dataclasses.dataclass
class EarlyMoves:
    done: dict[int, tuple[int, list[int]]] = dataclasses.field(default_factory=dict)
    failed: dict[int, tuple[int, list[int], str]] = dataclasses.field(default_factory=dict)

    def after_sampling(self, executor: RangeExecutor, seqs: Sequence[dict[str, Any]],
                       results: Sequence[dict[str, Any]], who: str = "shard") -> None:
        """Move the kept rows of each verify segment of a step the last shard has sampled
        (`results`: each segment's outcome, its `accepted` count and tree `path`; `who`: the
        shard, for the log)."""
        if isinstance(executor.kv, HybridState):
            return
        moves = []
        for seg, res in zip(seqs, results):
            kept = rows_to_move(res["path"]) if seg["draft"] is not None else None
            if kept:
                moves.append((seg["slot"], seg["pos"] + res["accepted"] + 1, kept))
        if not moves:
            return
        try:
            executor.before_steps(moves)
        except Exception as e:  # noqa: BLE001 - the result is out: the next step says it
            why = f"{type(e).__name__}: {e}"
            log.warning("%s: kept rows of slots %s not moved after their verify step (%s); "
                        "their next steps fail", who, [m[0] for m in moves], why)
            for slot, pos, kept in moves:
                self.failed[slot] = (pos, kept, why)
            return
        for slot, pos, kept in moves:
            self.done[slot] = (pos, kept)

    def for_step(self, seqs: Sequence[dict[str, Any]]) -> list[Move]:
        """(slot, pos, kept) of each segment of a step, for `RangeExecutor.before_steps`: kept
        rows that moved early left out. Every segment clears its slot's records: a new
        sequence's first step carries no kept rows, so a record never outlives its sequence's
        next step. RuntimeError when a segment carries kept rows for a slot whose early move
        failed (its rows may be half moved: moving them again would be silently wrong); the
        whole step fails with it, as a failed move always failed its step."""
        out: list[Move] = []
        broken = []
        for seg in seqs:
            slot, pos, kept = seg["slot"], seg["pos"], seg["kept"]
            done, failed = self.done.pop(slot, None), self.failed.pop(slot, None)
            if failed is not None and kept is not None:
                broken.append(f"slot {slot}: the kept rows of its last verify step could not "
                              f"be moved after it ({failed[2]})")
            out.append((slot, pos, None if done == (pos, kept) else kept))
        if broken:
            raise RuntimeError("; ".join(broken) + "; the sequence cannot go on")
        return out

    def clear(self) -> None:
        """Forget every record (a new session or configuration: the slots start over)."""
        self.done.clear()
        self.failed.clear()
