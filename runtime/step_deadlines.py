"""When a step in flight is late enough to call its shard hung.

A fixed timeout cannot be right for every step: a decode step of a small model takes a
millisecond, a prefill chunk of a large one seconds, and a loaded machine stretches both. A
step's budget is sized to its work instead: FACTOR times what steps of its kind have taken per
row so far (a moving average), never less than `floor_s`. Until a step of a kind has come back
(warm-up: first allocations, graph capture, compilation) the budget is `first_s`. Decode and
verify steps are kinds by their row count too: a step of a new shape may capture a CUDA graph
or compile one (a batch of a new size), so it is warm-up again; prefill chunks run eagerly.

Steps are pipelined, so a step may first wait for the ones in flight before it: its deadline
adds their usual times (their remaining allowance, for one still warming up) to its budget.
"""

from __future__ import annotations

from collections.abc import Iterable

FACTOR = 20.0  # a step this many times slower than its kind's average is hung
SMOOTHING = 0.2  # weight of the newest step in the moving average


class StepDeadlines:
    def __init__(self, floor_s: float, first_s: float) -> None:
        self.floor_s, self.first_s = floor_s, first_s
        self.per_row: dict[str, float] = {}  # kind -> seconds per row, moving average

    def budget(self, kind: str, rows: int) -> float:
        """Seconds a step of `kind` with `rows` rows may take."""
        per_row = self.per_row.get(_key(kind, rows))
        if per_row is None:
            return self.first_s
        return max(self.floor_s, FACTOR * per_row * max(rows, 1))

    def deadline(self, kind: str, rows: int, now: float,
                 ahead: Iterable[tuple[float, str, int]] = ()) -> float:
        """The monotonic time by which a step sent at `now` must be back; `ahead`: the steps
        in flight before it, as (deadline, kind, rows)."""
        wait = 0.0
        for due, k, n in ahead:
            per_row = self.per_row.get(_key(k, n))
            wait += max(0.0, due - now) if per_row is None else per_row * max(n, 1)
        return now + wait + self.budget(kind, rows)

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """A step of `kind` came back after `seconds` (from its sending)."""
        per_row = seconds / max(rows, 1)
        key = _key(kind, rows)
        old = self.per_row.get(key)
        self.per_row[key] = per_row if old is None else old + SMOOTHING * (per_row - old)

    def describe(self, kind: str, rows: int) -> str:
        per_row = self.per_row.get(_key(kind, rows))
        if per_row is None:
            return f"{self.first_s:.1f} s (step_timeout: no such step has come back yet)"
        return (f"{self.budget(kind, rows):.1f} s ({FACTOR:.0f} x {per_row * 1000:.2f} ms per "
                f"row of {rows}, at least step_deadline_min {self.floor_s:.1f} s)")


def _key(kind: str, rows: int) -> str:
    return kind if kind == "prefill" else f"{kind}:{rows}"
