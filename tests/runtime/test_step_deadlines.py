"""Step deadlines sized to the work (`runtime.step_deadlines`)."""

from __future__ import annotations

import pytest
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.step_deadlines import FACTOR, StepDeadlines


def test_budget_follows_what_steps_of_the_kind_took():
    d = StepDeadlines(floor_s=2.0, first_s=600.0)
    assert d.budget("decode", 1) == 600.0  # warm-up: nothing came back yet
    d.observe("decode", 1, 0.5)
    assert d.budget("decode", 1) == FACTOR * 0.5
    assert d.budget("decode", 2) == 600.0  # a new shape (a batch of 2) may capture a graph
    d.observe("decode", 1, 0.001)  # faster now: the average moves, the floor holds
    assert d.budget("decode", 1) == pytest.approx(FACTOR * (0.5 + 0.2 * (0.001 - 0.5)))
    for _ in range(60):
        d.observe("decode", 1, 0.001)
    assert d.budget("decode", 1) == 2.0
    d.observe("prefill", 16, 1.6)  # prefill: per row, any chunk size
    assert d.budget("prefill", 64) == FACTOR * 0.1 * 64
    assert "at least step_deadline_min 2.0 s" in d.describe("decode", 1)
    assert "no such step has come back" in d.describe("verify", 3)


def test_deadline_adds_the_usual_time_of_steps_ahead():
    d = StepDeadlines(floor_s=2.0, first_s=600.0)
    d.observe("prefill", 10, 1.0)
    d.observe("decode", 1, 0.01)
    now = 100.0
    # one known prefill chunk ahead (its usual time, not its budget) and one warming up (what
    # is left of its allowance)
    ahead = [(150.0, "prefill", 20), (130.0, "verify", 4)]
    assert d.deadline("decode", 1, now, ahead) == pytest.approx(now + 2.0 + 30.0 + 2.0)
    assert d.deadline("decode", 1, now) == now + 2.0


@pytest.mark.parametrize("kw,match", [({"step_deadline_min": 0}, "step_deadline_min=0"),
                                      ({"heartbeat_timeout": -1}, "heartbeat_timeout=-1"),
                                      ({"step_timeout": -5.0}, "step_timeout=-5.0")])
def test_bad_supervision_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig(**kw)
