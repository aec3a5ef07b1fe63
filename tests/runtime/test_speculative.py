"""runtime/speculative.py's pure helpers (which verify steps the warm-up at start captures), and
a sequence's `DraftClient` deciding which steps send the draft their rows (`taps`) and when a
round may go out after steps that did not, on a faked host and policy."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from layersplit.runtime.errors import DraftError, ShardFailure
from layersplit.runtime.speculative import (
    RESTART_ROWS,
    TAP_LEAD,
    DraftClient,
    SpecStats,
    warm_verify_rows,
)


def test_warm_rows_of_a_dense_target_take_chains_trees_and_policy_sizes():
    assert warm_verify_rows(8, 31, (31, 15, 7, 3), hybrid=False) == [4, 8, 16, 32]
    assert warm_verify_rows(16, 0, (), hybrid=False) == [16]


def test_warm_rows_of_a_hybrid_target_take_chain_lengths_only():
    """A hybrid target's tree steps run row by row: no graph (nor keep buffers) for them, not
    even for a tree no larger than the chain (the policy's sizes are the tree's then)."""
    assert warm_verify_rows(8, 31, (31, 15, 7, 3), hybrid=True) == [8]
    assert warm_verify_rows(16, 7, (7, 3), hybrid=True) == [16]
    assert warm_verify_rows(16, 0, (15, 7), hybrid=True) == [8, 16]


def test_warm_rows_without_a_chain_to_verify_are_none():
    assert warm_verify_rows(1, 0, (), hybrid=False) == []


# ---- DraftClient.taps and the rounds after untapped steps, on a faked host and policy ---------


@dataclasses.dataclass
class _Policy:
    """A policy whose plan and plain steps ahead the test sets."""

    size: int = 0
    left: int = 0
    end: int | None = None  # (set: the plain phase ends at this clock, `left` unused)

    def plan(self, batch: int, sampled: bool, clock: int) -> int:
        return self.size

    def plain_left(self, batch: int, sampled: bool, clock: int) -> int:
        return self.left if self.end is None else max(0, self.end - clock)

    def observe_plain(self, *a) -> None: ...
    def observe_round(self, *a) -> None: ...
    def observe_switch(self, *a) -> None: ...
    def observe_kept(self, *a) -> None: ...
    def observe_draft(self, *a) -> None: ...


class _Host:
    """The coordinator as a `DraftClient` sees it: its clock moves `pace` runtime steps each
    time the test says a step went out; draft requests are recorded (or fail)."""

    def __init__(self, policy: _Policy, fail: Exception | None = None) -> None:
        self.config = SimpleNamespace(spec_block=None, spec_tree=None)
        self.model_config = SimpleNamespace(vocab_size=100)
        self.chunk, self.push_drafts, self.spec_policy = 64, False, policy
        self.draft_info = {"kind": "dflash", "block_size": 16, "tree_nodes": 0}
        self.clock, self.asked, self.fail_with = 0, [], fail

    def spec_clock(self) -> tuple[int, int]:
        return self.clock, 1

    def draft_request(self, msg, frames=()):
        self.asked.append(msg)
        if self.fail_with is not None and msg["type"] == "draft_gap":
            raise self.fail_with
        return {"type": "ok"}

    def feat_sid(self, context: int) -> int:
        return 0

    def parked(self, context: int) -> bool:
        return False


def _client(policy: _Policy, required: bool = False, fail: Exception | None = None):
    host = _Host(policy, fail)
    return host, DraftClient(host, SpecStats(), required, context=3)


def _steps(host, client, positions, pace: int = 1) -> list[bool]:
    out = []
    for p in positions:
        host.clock += pace
        out.append(client.taps(p, True))
    return out


def test_a_long_plain_stretch_sends_no_rows_and_one_gap_when_rows_go_again():
    policy = _Policy(left=1000)
    host, c = _client(policy)
    assert _steps(host, c, range(100, 110)) == [False] * 10
    assert c.taps(110, False)  # (a step that may not skip: a prefill chunk, a verify step)
    assert host.asked == [{**host.asked[0], "type": "draft_gap", "slot": 3, "start": 100,
                           "end": 110}]
    assert c.stats.untapped == 10 and c.stats.restarts == 1 and c.resumed == 110
    policy.left = TAP_LEAD  # (the lead before a round: rows again, no second gap)
    assert _steps(host, c, range(111, 120)) == [True] * 9 and len(host.asked) == 1


def test_a_round_waits_for_the_rows_of_the_steps_since_a_gap_and_for_the_gap_itself():
    """While untapped steps wait to be told of (a batch of another size whose phase
    speculates came in between) no round goes out, nor before RESTART_ROWS steps sent rows
    again; a sequence's first rounds need no wait (no gap before them)."""
    policy = _Policy(size=15, left=1000)
    host, c = _client(policy)
    assert c._size(5) == 15  # (a short prompt's first round: no gap, nothing to wait for)
    assert _steps(host, c, [40, 41]) == [False, False]
    assert c._size(42) == 0  # (the gap not told yet)
    policy.left = 0
    assert c.taps(42, True) and host.asked[-1]["end"] == 42
    assert [c._size(p) for p in (43, 42 + RESTART_ROWS - 1)] == [0, 0]
    assert c._size(42 + RESTART_ROWS) == 15


def test_the_lead_is_counted_in_the_sequences_own_steps():
    """With the runtime's clock moving 3 steps for each of this sequence's (other
    micro-batches, prefill chunks), a plan TAP_LEAD runtime steps ahead is only a third of
    that in its own steps: it taps again already."""
    policy = _Policy(left=2 * TAP_LEAD)
    host, c = _client(policy)
    assert _steps(host, c, range(10, 14)) == [False] * 4  # (its pace not learnt yet)
    assert _steps(host, c, range(14, 40), pace=3)[-1] is True


def test_a_draft_that_fails_on_the_gap_fails_its_own_request_at_its_next_proposal():
    host, c = _client(_Policy(left=1000), required=True, fail=DraftError("gone"))
    assert _steps(host, c, [50, 51]) == [False, False]
    host.spec_policy.left = 0
    assert c.taps(52, True) is False  # (no raise in the batch's send: the step goes out)
    with pytest.raises(ShardFailure, match="spec_required"):
        c.propose([1] * 60, 53, 3, 16)
    host, c = _client(_Policy(left=1000), fail=DraftError("gone"))  # (not required)
    _steps(host, c, [50])
    host.spec_policy.left = 0
    assert c.taps(51, True) is False and not c.active
    assert c.propose([1] * 60, 52, 3, 16) == ([], None, None)


def test_an_untapped_step_sent_ahead_and_dropped_leaves_no_gap():
    host, c = _client(_Policy(left=1000))
    assert _steps(host, c, [70]) == [False]
    host.spec_policy.left = 0
    assert c.taps(70, True)  # (the same position again, now tapped)
    assert host.asked == [] and c.stats.restarts == 0


def test_rows_that_went_again_go_until_the_phase_ends_though_the_pace_falls():
    """A burst of other steps (3 runtime steps a step) brings the lead forward and rows go
    again; the pace falling back after it makes no second gap before the phase's end."""
    policy = _Policy(end=120)
    host, c = _client(policy)
    assert _steps(host, c, range(100, 110)) == [False] * 10  # (clock 10: 110 left)
    burst = _steps(host, c, range(110, 125), pace=3)  # (clock 55: 65 left, 3 x TAP_LEAD ahead)
    assert burst[-1] is True and len(host.asked) == 1
    assert c._pace > 2.5
    assert all(_steps(host, c, range(125, 135)))  # (pace near 1 again, 55-64 runtime steps left)
    assert c._pace < 1.5 and [m["type"] for m in host.asked] == ["draft_gap"]
    policy.end = host.clock + 500  # (a new off phase after the probe: a gap again)
    assert _steps(host, c, [135]) == [False]


def test_a_step_parks_only_where_the_sequences_next_own_step_is_plain_too():
    """`may_park` in the sequence's own steps: with 3 runtime steps to each of its own, a plain
    phase with 5 runtime steps left may end before its next step (that step would be a round,
    whose proposal needs this step's rows sent): not parked; with 7 left, parked."""
    policy = _Policy(left=1000)
    host, c = _client(policy)
    _steps(host, c, range(10, 30), pace=3)
    policy.left = 5
    assert not c.may_park()
    policy.left = 7
    assert c.may_park()


def test_untapped_steps_are_told_to_the_pacer_measuring_them():
    """The policy prices plain decoding by steps that sent the draft no rows: each untapped
    step's position goes to the sequence's Pacer, which measures it apart."""
    host, c = _client(_Policy(left=1000))
    assert _steps(host, c, range(100, 103)) == [False] * 3
    assert list(c.pacer._untapped) == [100, 101, 102]
