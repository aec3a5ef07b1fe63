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

A parked step costs the same however many rows are parked: one copy of its rows into a buffer
the shard makes at the first parked step and keeps (no allocation a step), however many
sequences the step has (`add_step`: a copy and a view per sequence were ~100 us of host time a
step of 8 sequences), and a few host operations (a run's end is counted as its steps park, not
summed over the run's rows at each step: that sum grew with the request, ~60 us a step over 128
tokens on a CPU; a run's pieces are views only once taken).

The runs come out in the order of their last step; the draft drops rows of a step older than the
start of its context's sequence (a context reused while its rows were parked), as it drops any
late feature frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
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
    """Consecutive positions of one draft context: rows [pos, end), the last of them from
    step `sid`; `rows` holds them in pieces (views of the parked rows' buffer, one per stretch
    that lies in it in one piece)."""

    sid: int
    context: int
    pos: int
    rows: list[torch.Tensor]
    end: int = -1  # pos + the rows' count, kept as they come (-1: counted from `rows`)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (parked) its
    # pieces' rows in the buffer, views in `rows` once taken: a step that goes on with its last
    # piece moves that piece's end, no view made a step (a sequence of a batch parks a piece a
    # step: its rows and the others' alternate)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.pos + sum(len(r) for r in self.rows)


def adjacent(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over `views` where each is the rows that follow the one before it in one
    tensor's memory (the segments of a batched step, tapped from one output), else None."""
    if not views:
        return None
    first = views[0]
    if len(views) == 1:
        return first
    if first.dim() != 2 or first.stride(1) != 1:
        return None
    storage, row = first.untyped_storage().data_ptr(), first.stride(0)
    at, rows = first.storage_offset(), 0
    for v in views:
        if (v.dim() != 2 or v.stride() != first.stride() or v.shape[1] != first.shape[1]
                or v.dtype != first.dtype or v.untyped_storage().data_ptr() != storage
                or v.storage_offset() != at):
            return None
        at += v.shape[0] * row
        rows += v.shape[0]
    return first.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())


@dataclasses.dataclass(slots=True)
class ParkedRows:
    """The rows parked on a shard, in the order their steps ran, in one buffer of `capacity`
    rows (`park_capacity` of the first row's size) made at the first and kept: a step's rows
    are written into it by one copy (no allocation), and a sequence's run of parked steps lies
    in it in one piece, sent as a view of it (no gathering)."""

    runs: list[Run] = dataclasses.field(default_factory=list)
    count: int = 0  # rows parked
    capacity: int = PARK_ROWS
    buffer: torch.Tensor | None = None  # (capacity, width): the parked rows [0, count)
    _open: dict[int, Run] = dataclasses.field(default_factory=dict)  # context -> its last run

    def add(self, sid: int, context: int, pos: int, parts: Sequence[torch.Tensor]) -> None:
        """Park the rows `parts` (each tapped layer's, put side by side; they live in buffers
        the next step overwrites, so they are copied) of `context` at positions
        [pos, pos + their rows), from step `sid`. The caller sends every parked row (`take`)
        when `full`."""
        self.add_step(sid, [(context, pos, parts[0].shape[0])], parts)

    def add_step(self, sid: int, segments: Sequence[tuple[int, int, int]],
                 parts: Sequence[torch.Tensor]) -> None:
        """`add` for several sequences of one step at once, by one copy: `segments` are their
        (context, pos, rows), whose rows lie in `parts` one after the other (a batched decode
        step's: one row each, so a copy per sequence would be most of a parked step's cost)."""
        n = parts[0].shape[0]
        if sum(rows for _, _, rows in segments) != n:
            raise ValueError(f"segments of {sum(r for _, _, r in segments)} rows for {n} "
                             "rows parked")
        buf = self.buffer
        if buf is None:  # (rows of one width, dtype and device until `clear`)
            width = sum(p.shape[-1] for p in parts)
            self.capacity = park_capacity(width * parts[0].element_size())
            buf = self.buffer = torch.empty(self.capacity, width, dtype=parts[0].dtype,
                                            device=parts[0].device)
        a = self.count
        if a + n > self.capacity:  # (a step wider than the room left: sent first)
            raise ValueError(f"{a + n} parked rows exceed the {self.capacity} there is room for")
        torch.cat(parts, dim=-1, out=buf[a:a + n])
        self.count = a + n
        for context, pos, rows in segments:
            self._extend(sid, context, pos, a, rows)
            a += rows

    def _extend(self, sid: int, context: int, pos: int, a: int, n: int) -> None:
        """`context`'s rows [pos, pos + n), parked at rows [a, a + n) of the buffer."""
        run = self._open.get(context)
        if run is None or run.end != pos:  # (a new sequence, or a position written again)
            run = self._open[context] = Run(sid, context, pos, [], end=pos)
            self.runs.append(run)
        if run.spans and run.spans[-1][1] == a:  # (its last piece goes on)
            run.spans[-1] = (run.spans[-1][0], a + n)
        else:
            run.spans.append((a, a + n))
        run.end += n
        run.sid = sid

    def room(self, n: int) -> bool:
        """Whether `n` more rows fit."""
        return self.count + n <= self.capacity

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def take(self) -> list[Run]:
        """Every run, in the order of its last step; none is parked after. Its rows are views
        of the buffer, which the next `add` writes again: send them first (a device copy out
        of them is queued on the stream the next `add`'s copy runs on)."""
        runs = sorted(self.runs, key=lambda r: r.sid)  # (stable: a context's runs keep order)
        for run in runs:
            run.rows += [self.buffer[a:b] for a, b in run.spans]  # (views made once, here)
            run.spans = []
        self.runs, self.count = [], 0
        self._open.clear()
        if self.buffer is not None and self.buffer.device.type == "cpu":
            self.buffer = None  # (a zmq frame of a CPU tensor is sent without a copy, after
            # the send returns: the next rows go to a new buffer)
        return runs

    def clear(self) -> None:
        """Drop every parked row, and the buffer (the next rows may be another draft's)."""
        self.take()
        self.buffer = None


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
