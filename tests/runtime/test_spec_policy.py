"""The speculation policy (`spec_policy`) on a faked cost model: it turns speculation off where a
round costs more than the tokens it commits are worth, on where it pays, back on or off when the
costs change, chooses the size that pays best, and keeps batch sizes apart."""

from __future__ import annotations

import pytest
from layersplit.runtime.spec_policy import (
    Pacer,
    PolicyKnobs,
    SpecPolicy,
    bucket,
    committed_by_size,
    policy_sizes,
    tree_ranks,
)

TREE = [31, 15, 7, 3]


def run(policy, steps, t_plain, t_round, accepted, batch=1, sampled=False, state=None):
    """One sequence through `policy` for `steps` steps on a faked cost model: a plain step
    takes `t_plain(batch)` seconds; a round of size s takes `t_round(s, batch)` and keeps
    `accepted(s)` draft tokens (a chain's, so smaller sizes keep min(accepted, s)). Returns
    the sizes of its steps and the tokens a second over the run; `state` carries the sequence
    on (time, position, clock, pacer) from one call to the next."""
    now, pos, clock, pacer = state or (0.0, 0, 0, Pacer(policy, sampled))
    sizes, t0, p0 = [], now, pos
    for _ in range(steps):
        size = pacer.step(pos, batch, clock, now)
        if size:
            kept = min(accepted(size), size)
            pacer.ran(size, pos + kept + 1,
                      committed_by_size(policy.sizes, size, list(range(kept))))
            pos, now = pos + kept + 1, now + t_round(size, batch)
        else:
            pos, now = pos + 1, now + t_plain(batch)
        clock += 1
        sizes.append(size)
    if state is not None:
        state[:] = [now, pos, clock, pacer]
    return sizes, (pos - p0) / (now - t0)


def plain(_b=1):
    return 1.0


def test_speculation_turns_off_where_a_round_loses():
    """A round costs 3 plain steps and keeps one draft token: plain decoding wins. The policy
    goes off after its first look and stays off (probing now and then, less and less often):
    over the run it is within a few per cent of plain decoding's speed."""
    policy = SpecPolicy(TREE)
    sizes, rate = run(policy, 3000, plain, lambda s, b: 3.0, lambda s: 1)
    assert sizes[:5] == [31] * 5  # a first look at the whole tree
    assert sum(s == 0 for s in sizes[-1000:]) >= 990
    assert rate > 0.97  # plain: 1 token a second
    assert policy.choice(1, False) == 0 and policy.stats.probes >= 3
    assert policy.stats.off_steps > 2900


def test_speculation_stays_on_where_it_pays():
    """A round costs 1.2 plain steps and keeps 3 draft tokens: speculation at ~3.3 x plain. It
    stays on, with a few plain steps now and then to measure plain decoding's cost."""
    policy = SpecPolicy(TREE)
    sizes, rate = run(policy, 3000, plain, lambda s, b: 1.2, lambda s: 3)
    assert sum(s > 0 for s in sizes[-1000:]) >= 900
    assert rate > 0.9 * 4 / 1.2
    assert policy.choice(1, False) > 0


def test_speculation_comes_back_on_and_goes_off_again_as_the_costs_change():
    policy = SpecPolicy(TREE)
    state = [0.0, 0, 0, Pacer(policy, False)]
    run(policy, 500, plain, lambda s, b: 4.0, lambda s: 1, state=state)
    assert policy.choice(1, False) == 0
    sizes, _ = run(policy, 2000, plain, lambda s, b: 1.1, lambda s: 3, state=state)  # pays now
    assert policy.choice(1, False) > 0 and sum(s > 0 for s in sizes[-500:]) >= 450
    sizes, _ = run(policy, 500, plain, lambda s, b: 5.0, lambda s: 1, state=state)  # not again
    assert policy.choice(1, False) == 0 and sum(s == 0 for s in sizes[-200:]) >= 195


def test_the_size_that_pays_best_is_chosen():
    """Rounds cost more with every draft row (a batched verify step) and keep at most 3 draft
    tokens: the smallest tree that keeps them (3) pays best. When rows cost nothing and a larger
    tree keeps more, the whole tree does."""
    policy = SpecPolicy(TREE)
    sizes, rate = run(policy, 3000, plain, lambda s, b: 1.0 + 0.1 * s, lambda s: 3)
    assert policy.choice(1, False) == 3
    assert sum(s == 3 for s in sizes[-1000:]) >= 850
    assert rate > 0.85 * 4 / 1.3
    policy = SpecPolicy(TREE)
    run(policy, 2000, plain, lambda s, b: 1.5, lambda s: s // 3)
    assert policy.choice(1, False) == 31


def test_batch_sizes_and_sampled_requests_are_decided_apart():
    """One sequence pays where it decodes alone and loses in a batch of 8 (its verify rows cost
    more there); sampled requests keep fewer draft tokens than greedy ones and lose."""
    policy = SpecPolicy(TREE)
    cost = {1: 1.2, 8: 6.0}
    run(policy, 1500, plain, lambda s, b: cost[b], lambda s: 3, batch=1)
    run(policy, 1500, plain, lambda s, b: cost[b], lambda s: 3, batch=8)
    run(policy, 1500, plain, lambda s, b: cost[b], lambda s: 0, batch=1, sampled=True)
    assert policy.choice(1, False) > 0
    assert policy.choice(8, False) == 0
    assert policy.choice(1, True) == 0
    assert policy.choice(5, False) == 0  # (5 sequences: the bucket of 8)
    assert policy.stats.size == {1: policy.choice(1, True), 8: 0}  # (the last decision)


def test_a_batch_where_one_sequence_speculates_weighs_the_others():
    """32 sequences, one of them speculating (spec_max_seqs 1): its verify rows make the
    batch's step 20 % slower, and it commits 4 tokens a round. It alone would gain 3.3 x; the
    batch commits 35 tokens a step instead of 32 at 1.2 x the time: it loses, so off. With all
    32 speculating it pays."""
    cost = {1: 1.2}
    for spec_seqs, on in ((1, False), (32, True)):
        policy = SpecPolicy(TREE, spec_seqs=spec_seqs)
        run(policy, 1500, plain, lambda s, b: cost[1], lambda s: 3, batch=32)
        assert (policy.choice(32, False) > 0) is on


def test_a_margin_keeps_a_choice_against_a_hair_better_one():
    policy = SpecPolicy([7], PolicyKnobs(margin=0.05))
    policy.observe_plain(1, 1.0)
    policy.observe_round(1, 7, 2.0)
    policy.observe_kept(False, {7: 2})  # 1.0 token a second either way
    assert policy.decide(1, False, 7) == 7 and policy.decide(1, False, 0) == 0
    policy.observe_kept(False, {7: 3})  # 2.15 tokens a round: 7.5 % better
    assert policy.decide(1, False, 0) == 7


def test_an_unmeasured_size_is_priced_between_its_measured_neighbours():
    policy = SpecPolicy(TREE)
    assert policy.round_time(1, 15) is None
    policy.observe_plain(1, 1.0)
    policy.observe_round(1, 31, 4.1)
    assert policy.round_time(1, 31) == pytest.approx(4.1)
    assert policy.round_time(1, 15) == pytest.approx(1.0 + 3.1 * 15 / 31)
    policy.observe_round(1, 7, 2.0)
    assert policy.round_time(1, 15) == pytest.approx(2.0 + 2.1 * 8 / 24)
    assert policy.round_time(2, 15) is None  # another batch bucket


def test_steps_after_a_switch_are_not_measured():
    """The first step of a kind pays for the switch (kept rows moved, the draft catching up):
    only a step that came after one of the same size is measured, and only when the next one
    is where it led (one step, not two, between)."""
    policy = SpecPolicy([3], PolicyKnobs(spec_steps=2, refresh=2, probe=2))
    pacer = Pacer(policy, False)
    assert pacer.step(10, 1, 0, 0.0) == 3  # first look
    pacer.ran(3, 12, {3: 2})
    assert pacer.step(12, 1, 1, 5.0) == 3  # (the first round: not measured)
    assert policy.round_time(1, 3) is None
    pacer.ran(3, 14, {3: 2})
    assert pacer.step(14, 1, 2, 7.0) == 0  # refresh; the second round took 2 s
    assert policy.round_time(1, 3) == pytest.approx(2.0)
    assert pacer.step(15, 1, 3, 10.0) == 0
    assert policy.plain_time(1) is None  # (the first plain step: not measured)
    pacer.step(17, 1, 4, 11.0)  # a position skipped: not one step
    assert policy.plain_time(1) is None


def test_candidate_sizes_and_what_smaller_ones_would_have_kept():
    assert policy_sizes(31) == [31, 15, 7, 3]
    assert policy_sizes(7) == [7, 3, 1]
    assert policy_sizes(1) == [1]
    assert [bucket(b) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    # a chain of 7 kept 4: a chain of 3 would have kept 3, one of 1 one
    assert committed_by_size([7, 3, 1], 7, [0, 1, 2, 3]) == {7: 5, 3: 4, 1: 2}
    # a tree: rows in depth-first order, each row's priority in the shape
    shape = [[0], [1], [0, 0], [2], [0, 0, 0], [1, 0], [0, 1]]
    assert tree_ranks(shape, 7, 3) == [0, 2, 4, 6, 1, 5, 3]
    assert tree_ranks(shape, 7, 2) == [0, 2, 5, 1, 4, 3]  # (no path deeper than 2)
    # the path kept (1, 0) -> rows 5, 6 of the depth-first order: priorities 1, 5
    assert committed_by_size([7, 3], 7, [1, 5]) == {7: 3, 3: 2}
    with pytest.raises(ValueError, match="sizes"):
        SpecPolicy([])
    with pytest.raises(ValueError, match="at least 2"):
        PolicyKnobs(refresh=1)

