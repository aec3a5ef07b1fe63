"""The warm-up's settings and estimate (`runtime.warmup`, `shards.graphs.warm_left`), and the
server's engine running the warm-up requests before it says ready (CPU shards, `warmup = on`);
`layersplit warmup` end to end is in tests/launch/test_warmup_cli.py (CPU) and
tests/gpu/test_ready.py."""

from __future__ import annotations

import logging
import time

import pytest
from layersplit.runtime import engine as engine_module
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.engine import Engine
from layersplit.runtime.metrics import Metrics
from layersplit.shards.graphs import warm_left

from tests.helpers import shard_children


def test_warmup_takes_auto_on_or_off_and_refuses_others():
    assert RuntimeConfig().warmup == "auto"
    assert RuntimeConfig(warmup="off").warmup == "off"
    with pytest.raises(ConfigError, match="warmup='sometimes': must be one of auto, on, off"):
        RuntimeConfig(warmup="sometimes")


def test_the_estimate_is_the_pace_capped_by_the_last_warm_up():
    assert warm_left(10.0, 20, 100, None) == pytest.approx(40.0)  # 0.5 s a graph, 80 left
    assert warm_left(10.0, 20, 100, 30.0) == pytest.approx(20.0)  # the last one took 30 s
    assert warm_left(40.0, 20, 100, 30.0) == 0.0
    assert warm_left(1.0, 0, 10, None) == pytest.approx(10.0)


@pytest.mark.slow
def test_the_server_engine_warms_up_before_it_is_ready(tiny_llama, caplog, monkeypatch):
    """`serve`'s engine, in this process: its status reads "warming up" while the warm-up
    requests run, and once it reads ready, every one of them has run, and the shards were
    asked to capture their prefill graphs (`warm_prefill`), once."""
    # (a failed start would SIGTERM the server process, here pytest: it fails the test instead)
    monkeypatch.setattr(engine_module, "_exit_soon", lambda: None)
    caplog.set_level(logging.INFO, logger="layersplit.runtime.warmup")
    asked: list[int] = []  # the prefill graphs' buckets each shard captured (CPU: none)
    real = Coordinator.warm_prefill_graphs
    monkeypatch.setattr(Coordinator, "warm_prefill_graphs",
                        lambda self: asked.append(real(self)) or asked[-1])
    eng = Engine(RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), threads=1,
                               prefill_chunk=16, max_context=256, draft="none", warmup="on"),
                 Metrics())
    seen: list[tuple[str, str]] = []
    eng.start()
    try:
        deadline = time.monotonic() + 120
        while eng.status != "ready":
            state = (eng.status, eng.reason)
            if not seen or seen[-1] != state:
                seen.append(state)
            assert eng.status != "degraded", eng.reason
            assert time.monotonic() < deadline, f"not ready: {seen}"
            time.sleep(0.002)
        said = caplog.text  # (what was logged by the time it said ready)
    finally:
        eng.stop(5)
    assert ("loading", "warming up") in seen
    assert asked == [0]  # (asked of the shards before ready, once; CPU shards capture none)
    assert "warm-up 1 of 3: a prefill of 33 tokens and 8 greedy tokens" in said
    assert "warm-up 3 of 3: a batch of two" in said and "warm-up requests done" in said
    assert shard_children() == []
