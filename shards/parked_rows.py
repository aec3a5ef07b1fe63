"""Feature rows a shard keeps on its device instead of sending them to the draft process, while
the speculation policy has every sequence of a step decode plainly (a step message's `park`).

Why: sending the draft a step's tapped rows costs each step a copy into the draft's ring, the
draft's own device work and a wait across the two processes' streams, and while speculation is
off nothing reads those rows. Parked, they go in one message per run of a context's positions
(`runs`) when something may read them: before the rows of the next step that is not parked
(a round's proposal reads the rows of every step before it, and the coordinator makes a round
wait for one plain step that is not parked), before a prefix-cache snapshot (`snap_take`), or
when `park_capacity` rows are parked (32 MiB of them, thousands of rows: a request that does
not speculate at all sends them once, when its draft context is used next, and the draft
process is not woken every few hundred steps).

The runs come out in the order of their last step; the draft drops rows of a step older than the
start of its context's sequence (a context reused while its rows were parked), as it drops any
late feature frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from layersplit.ipc.messages import message

PARK_BYTES = 32 << 20  # device memory a shard parks rows in (then it sends them) ...
PARK_ROWS = 256  # ... but room for this many rows at least
PARK_ROWS_MAX = 8192  # ... and at most


def park_capacity(row_bytes: int) -> int:
    """Rows a shard parks at most, each of `row_bytes`: `PARK_BYTES` of them, within
    [`PARK_ROWS`, `PARK_ROWS_MAX`] (the default model's one shard, 4 tapped layers in bf16:
    ~7,000)."""
    return max(PARK_ROWS, min(PARK_ROWS_MAX, PARK_BYTES // max(1, row_bytes)))


@dataclasses.dataclass(slots=True)
class Run:
    """Consecutive positions of one draft context: rows [pos, pos + len(rows)), the last of
    them from step `sid`."""

    sid: int
    context: int
    pos: int
    rows: list[torch.Tensor]

    @property
    def end(self) -> int:
        return self.pos + sum(len(r) for r in self.rows)


@dataclasses.dataclass(slots=True)
class ParkedRows:
    """The rows parked on a shard, in the order their steps ran: at most `capacity`
    (`park_capacity` of the first row's size)."""

    runs: list[Run] = dataclasses.field(default_factory=list)
    count: int = 0  # rows parked
    capacity: int = PARK_ROWS
    _open: dict[int, Run] = dataclasses.field(default_factory=dict)  # context -> its last run

    def add(self, sid: int, context: int, pos: int, rows: torch.Tensor) -> None:
        """Park `rows` (a copy the caller made: tapped rows live in buffers the next step
        overwrites) of `context` at positions [pos, pos + len(rows)), from step `sid`."""
        if not self.count:
            self.capacity = park_capacity(rows.shape[-1] * rows.element_size())
        run = self._open.get(context)
        if run is None or run.end != pos:  # (a new sequence, or a position written again)
            run = self._open[context] = Run(sid, context, pos, [])
            self.runs.append(run)
        run.rows.append(rows)
        run.sid = sid
        self.count += len(rows)

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def take(self) -> list[Run]:
        """Every run, in the order of its last step; none is parked after."""
        runs = sorted(self.runs, key=lambda r: r.sid)  # (stable: a context's runs keep order)
        self.runs, self.count = [], 0
        self._open.clear()
        return runs

    def clear(self) -> None:
        self.take()


def feature_messages(runs: list[Run], piece: int, layers: list[int],
                     last: bool) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """The `feat` messages (header, rows) that send `runs`, at most `piece` rows each (what a
    feed message holds); `last`: the final one says the draft has every step's rows up to its
    own."""
    for k, run in enumerate(runs):
        rows = run.rows[0] if len(run.rows) == 1 else torch.cat(run.rows)
        for a in range(0, len(rows), piece):
            b = min(len(rows), a + piece)
            end = last and k == len(runs) - 1 and b == len(rows)
            yield message("feat", sid=run.sid, slot=run.context, pos=run.pos + a, n=b - a,
                          layers=layers, last=end, act=None), rows[a:b]
