"""The warm-up's settings and estimate (`runtime.warmup`, `shards.graphs.warm_left`); the warm-up
itself runs end to end in tests/launch/test_warmup_cli.py (CPU) and tests/gpu/test_ready.py."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.shards.graphs import warm_left


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
