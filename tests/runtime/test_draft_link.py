"""`runtime.draft_link`: the start's last wait on the draft process (`_draft_warmed`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from layersplit.runtime.draft_link import DraftLink
from layersplit.runtime.errors import ShardFailure


def test_a_draft_lost_before_its_warm_up_was_answered_fails_the_start():
    """A draft process that died while the shards warmed up (their waits saw it first and
    dropped it) fails the start as a failed warm-up does, naming why; with no draft at all
    there is nothing to wait for."""
    lost = SimpleNamespace(draft=None, draft_path="/drafts/d", draft_down="killed by signal 9")
    with pytest.raises(ShardFailure, match="could not start: killed by signal 9"):
        DraftLink._draft_warmed(lost, 0.0)
    DraftLink._draft_warmed(SimpleNamespace(draft=None, draft_path=None, draft_down=None), 0.0)
