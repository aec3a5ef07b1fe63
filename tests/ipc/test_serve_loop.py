"""`ipc.serve_loop.serve`: a sleeper with rings looks at them every SLEEP_POLL_MS at first, less
and less often once idle past IDLE_BACKOFF_S (up to IDLE_POLL_MS), and at once again after a
message or work; one without rings blocks long."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from layersplit.ipc import serve_loop
from layersplit.ipc.serve_loop import IDLE_BACKOFF_S, IDLE_POLL_MS, serve
from layersplit.ipc.shm import SLEEP_POLL_MS


class Ring:
    closed = False

    def __init__(self) -> None:
        self.asleep: list[bool] = []

    def sleep(self, value: bool) -> None:
        self.asleep.append(value)

    def ready(self) -> bool:
        return False


def _serve(monkeypatch, blocks: int, rings: list, worked_at=(), took_at=()):
    """Run `serve` on a faked clock for `blocks` blocks: each block takes its timeout; work is
    done at the loop turns `worked_at`, a message taken by the blocks `took_at`. Returns the
    blocks' timeouts."""
    now = [0.0]
    monkeypatch.setattr(serve_loop, "time", SimpleNamespace(monotonic=lambda: now[0]))
    timeouts: list[int] = []
    turns = [0]

    def work() -> bool:
        turns[0] += 1
        return turns[0] in worked_at

    def block(ms: int) -> bool:
        timeouts.append(ms)
        now[0] += ms / 1000.0
        return len(timeouts) in took_at

    serve(lambda: len(timeouts) < blocks, work, lambda: rings, block, lambda: 0.0)
    return timeouts


def test_an_idle_sleeper_looks_at_its_rings_less_and_less_often(monkeypatch):
    ring = Ring()
    got = _serve(monkeypatch, 200, [ring])
    first = int(IDLE_BACKOFF_S * 1000 / SLEEP_POLL_MS)
    assert got[:first] == [SLEEP_POLL_MS] * first
    assert got[first:first + 4] == [2 * SLEEP_POLL_MS, 4 * SLEEP_POLL_MS, 8 * SLEEP_POLL_MS,
                                    16 * SLEEP_POLL_MS]
    assert got[-1] == IDLE_POLL_MS and max(got) == IDLE_POLL_MS
    # ~30 looks a second once idle, not 500
    assert sum(got[-30:]) / 1000 == pytest.approx(30 * IDLE_POLL_MS / 1000)
    assert ring.asleep[:2] == [True, False]  # (marked asleep around each block)


def test_a_message_or_work_brings_the_short_polls_back(monkeypatch):
    got = _serve(monkeypatch, 200, [Ring()], took_at={150})
    assert got[149] == IDLE_POLL_MS and got[150] == SLEEP_POLL_MS  # (a message taken)
    assert got[151:155] == [SLEEP_POLL_MS] * 4  # (idle again from then on: short polls first)
    turns = 150 + 1  # (each loop turn works once, then blocks once)
    got = _serve(monkeypatch, 200, [Ring()], worked_at={turns})
    assert got[149] == IDLE_POLL_MS and got[150:154] == [SLEEP_POLL_MS] * 4


def test_a_sleeper_without_rings_blocks_on_its_sockets_alone(monkeypatch):
    assert set(_serve(monkeypatch, 5, [])) == {200}
