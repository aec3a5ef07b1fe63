"""The engine's account of a request's time to its first token, phase by phase."""

from __future__ import annotations

import pytest
from layersplit.runtime.engine import PHASES, Job, phases
from layersplit.runtime.generate import Progress


def test_phases_are_never_negative_and_add_up():
    """Marks out of order (a mark set again after the first token: none should be, but a
    clock's step or a later run's mark counts as no time) give no negative phase, and the
    phases still add up to the time to the first token."""
    job = Job(req=None, loop=None, out=None, arrived=10.0)
    job.marks.update(parsed=10.5, taken=11.0, tokenized=11.5, queued=12.0)
    progress = Progress()
    progress.marks.update(admitted=15.0, restored=15.5)  # (later than its first token)
    progress.first_token_at = 14.0
    got = phases(job, progress, first_out=16.0)
    assert set(got) == {name for name, _ in PHASES}
    assert all(v >= 0 for v in got.values()), got
    assert got["prefill"] == 0 and got["emit"] == 0.5
    assert sum(got.values()) == pytest.approx(6.0)
