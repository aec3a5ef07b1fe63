"""The coordinator's side of speculative decoding: asking the draft process for proposals, and
what speculation achieved (acceptance per position, draft and verify time).

The loop itself is `runtime.generate.token_stream` with a `Drafter`; verification happens on the
last shard (`shards.sampling.accept_draft`). A draft that fails stops speculation, never the
generation: the request goes on with plain decode steps (logged), unless the configuration
demands speculation (`spec_required`), in which case the request fails with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ipc.messages import message
from runtime.errors import DraftError, DraftLost, ShardFailure

if TYPE_CHECKING:
    from runtime.coordinator import Coordinator

log = logging.getLogger(__name__)


def draft_taps(path: str | Path | None) -> list[int]:
    """The target layers a feature-conditioned draft reads ([] for a classic draft)."""
    from draft.dflash import is_dflash, read_dflash_config

    if path is None or not Path(str(path)).is_dir() or not is_dflash(Path(path)):
        return []
    return list(read_dflash_config(Path(path)).target_layer_ids)


@dataclasses.dataclass
class SpecStats:
    """What speculation did for one request (or, summed, for a run)."""

    verifies: int = 0
    committed: int = 0  # tokens the verify steps committed: kept draft tokens + one each
    proposed_at: list[int] = dataclasses.field(default_factory=list)  # by draft position
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0  # proposals, as the coordinator waits for them
    draft_compute_s: float = 0.0  # of which the draft process computed
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per verify step (1 = no draft token kept)."""
        return self.committed / self.verifies if self.verifies else None

    def acceptance_rates(self) -> list[float]:
        """Fraction of proposals whose j-th draft token was kept, j = 1, 2, ..."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def _grow(self, n: int) -> None:
        if n > len(self.proposed_at):
            self.proposed_at += [0] * (n - len(self.proposed_at))
            self.accepted_at += [0] * (n - len(self.accepted_at))

    def add(self, proposed: int, accepted: int) -> None:
        """One verify step kept `accepted` of `proposed` draft tokens."""
        self.verifies += 1
        self.committed += accepted + 1
        self._grow(proposed)
        for j in range(proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    def merge(self, other: SpecStats) -> None:
        self.verifies += other.verifies
        self.committed += other.committed
        self.draft_s += other.draft_s
        self.draft_compute_s += other.draft_compute_s
        self.verify_s += other.verify_s
        self._grow(len(other.proposed_at))
        for j, (p, a) in enumerate(zip(other.proposed_at, other.accepted_at)):
            self.proposed_at[j] += p
            self.accepted_at[j] += a


class DraftClient:
    """The `Drafter` of one sequence: proposals from the draft process."""

    def __init__(self, coord: Coordinator, stats: SpecStats, required: bool,
                 context: int) -> None:
        """`context`: the sequence's context in the draft process (its rows and draft KV)."""
        self.coord, self.stats, self.required, self.context = coord, stats, required, context
        info = coord.draft_info
        self.kind = info["kind"]
        # a verify step is a step: no more rows than the shards take (prefill_chunk)
        self.block = min(int(coord.config.spec_block or info["block_size"]),
                         int(info["block_size"]), coord.chunk)
        self.vocab = coord.model_config.vocab_size
        self.start = 0  # classic: the draft's own KV holds the committed rows [0, start)
        self.active = True
        self._t_proposed = 0.0

    def begin(self) -> None:
        """A new sequence: the draft forgets the last one."""
        try:
            self.coord.draft_request(message("draft_begin", slot=self.context))
        except (DraftLost, DraftError) as e:
            self._stop(e)

    def _stop(self, e: Exception) -> None:
        self.active = False
        if self.required:
            why = f"speculation is required (spec_required) but the draft failed: {e}"
            if isinstance(e, DraftLost):  # the whole group restarts (the server), draft included
                raise self.coord._fail(why)
            raise ShardFailure(why, runtime_down=False)
        log.warning("this request goes on without speculation: %s", e)

    def propose(self, seq: Sequence[int], pos: int, n: int) -> list[int]:
        if not self.active:
            return []
        t0 = time.perf_counter()
        frames = []
        start = 0
        if self.kind == "classic":
            start = self.start
            frames = [np.asarray(seq[start:pos], dtype=np.int64)]
        try:
            reply = self.coord.draft_request(message(
                "propose", slot=self.context, pos=pos, n=n, token=int(seq[pos]), start=start,
                sync=self.coord.feat_sid(self.context)), frames)
            tokens = reply.get("tokens") if reply.get("type") == "proposal" else None
            if not isinstance(tokens, list) or len(tokens) > n or not all(
                    isinstance(t, int) and 0 <= t < self.vocab for t in tokens):
                raise DraftError(f"the draft proposed {str(tokens)[:80]}: not up to {n} token "
                                 "ids of the vocabulary")
        except (DraftLost, DraftError) as e:
            self._stop(e)
            return []
        now = time.perf_counter()
        self.stats.draft_s += now - t0
        compute = reply.get("compute_s")
        if isinstance(compute, float):
            self.stats.draft_compute_s += compute
        self._t_proposed = now
        return tokens

    def verified(self, pos: int, proposed: int, accepted: int) -> None:
        self.stats.verify_s += time.perf_counter() - self._t_proposed
        self.stats.add(proposed, accepted)
        if self.kind == "classic":  # its rows [pos, pos + kept] were computed from kept tokens
            self.start = pos + min(accepted, proposed - 1) + 1
