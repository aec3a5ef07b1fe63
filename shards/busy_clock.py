"""How long a shard's device spent on steps (`busy_s` in its `pong`; a utilization profile
reads it).

On the CPU a step's compute is its wall time. On a GPU the host no longer waits for a step (a
cuda-ipc hop is ordered by events, `ipc.cuda_handoff`), so the time is taken on the device: an
event before the step's first kernel and one after its last, read once they have run. A step
that waits for its input starts counting when the input has arrived.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class BusyClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.total = 0.0
        self.pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.spare: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        ev = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> object:
        return self._event() if self.cuda else time.perf_counter()

    def stop(self, started: object) -> None:
        if not self.cuda:
            self.total += time.perf_counter() - started
            return
        self.pending.append((started, self._event()))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        while self.pending and (wait or self.pending[0][1].query()):
            begin, end = self.pending.popleft()
            end.synchronize()
            self.total += begin.elapsed_time(end) / 1000.0
            self.spare += (begin, end)

    def seconds(self) -> float:
        """Busy seconds so far, steps still running included (waited for)."""
        self._settle(wait=True)
        return self.total
