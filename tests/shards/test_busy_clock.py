"""A shard's busy time on the CPU: the wall time of its steps, and nothing between them."""

from __future__ import annotations

import time

import torch
from layersplit.shards.busy_clock import BusyClock


def test_cpu_busy_time_counts_steps_only():
    clock = BusyClock(torch.device("cpu"))
    assert clock.seconds() == 0.0
    for _ in range(3):
        started = clock.start()
        time.sleep(0.02)
        clock.stop(started)
        time.sleep(0.05)  # idle: not counted
    assert 0.06 <= clock.seconds() < 0.15
