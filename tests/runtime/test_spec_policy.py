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
LOOK = PolicyKnobs().refresh + PolicyKnobs().lead  # a bucket's first look: plain steps that send
# the draft no rows (what plain decoding costs), then ones that do (the probe's draft reads them)


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
    assert sizes[:LOOK + 4] == [0] * LOOK + [31] * 4  # a first look: plain steps, the tree
    assert sum(s == 0 for s in sizes[-1000:]) >= 990
    assert rate > 0.97  # plain: 1 token a second
    assert policy.choice(1, False) == 0 and policy.stats.probes >= 3
    assert policy.stats.off_steps > 2900


def test_a_hopeless_probe_and_a_hopeless_look_at_a_smaller_size_end_early():
    """A round costs 8 plain steps at any size and keeps one draft token (a launch-bound target,
    or a CPU's row-by-row verify): hopeless. The first probe ends after two measured rounds at
    the whole tree (its third), though the smallest tree, never run, is priced as if it paid;
    the look at that one ends after its two measured rounds too, not at its end: speculation is
    off after the first look and 5 rounds, and within a few per cent of plain decoding."""
    policy = SpecPolicy(TREE)
    sizes, rate = run(policy, 3000, plain, lambda s, b: 8.0, lambda s: 1)
    assert sizes[:LOOK + 5] == [0] * LOOK + [31] * 3 + [3] * 2
    assert set(sizes[LOOK + 5:1000]) == {0}
    assert policy.choice(1, False) == 0
    assert rate > 0.97


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


def test_a_probe_decides_on_its_own_rounds_not_on_those_of_a_losing_phase_before():
    """Speculation pays, then loses for a while (a window full of slow rounds: off), then pays
    again: the first probe's few rounds decide (the slow rounds before the off phase would
    outvote them, and off phases double while probes lose), so it comes back on at its first
    probe (532 steps on: the off phase long enough that a probe as losing as the phase before's
    rounds costs at most 1 % of it, `probe_budget`)."""
    policy = SpecPolicy(TREE)
    state = [0.0, 0, 0, Pacer(policy, False)]
    run(policy, 400, plain, lambda s, b: 1.1, lambda s: 3, state=state)
    assert policy.choice(1, False) > 0
    run(policy, 300, plain, lambda s, b: 6.0, lambda s: 3, state=state)
    assert policy.choice(1, False) == 0 and policy._round[1, 31].count > 12
    sizes, _ = run(policy, 1200, plain, lambda s, b: 1.1, lambda s: 3, state=state)
    assert policy.choice(1, False) > 0 and sum(s > 0 for s in sizes[600:]) > 500


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


def test_speculation_is_chosen_only_where_it_beats_plain_decoding_by_its_gain():
    """At a tie plain steps are the safe choice: speculating goes off at a tie, and comes on
    only where it is `gain` (5 %) and `margin` (3 %) faster."""
    policy = SpecPolicy([7])
    policy.observe_plain(1, 1.0)
    policy.observe_round(1, 7, 2.0)
    policy.observe_kept(False, {7: 2})  # 1.0 token a second either way
    assert policy.decide(1, False, 7) == 0 and policy.decide(1, False, 0) == 0
    policy.observe_kept(False, {7: 3})  # 2.15 tokens a round (EMA): 7.5 % better
    assert policy.kept(False, 7) == pytest.approx(2.15)
    assert policy.decide(1, False, 0) == 0 and policy.decide(1, False, 7) == 7
    policy.observe_kept(False, {7: 3})  # 2.28: 14 % better
    assert policy.decide(1, False, 0) == 7


def test_a_margin_keeps_a_choice_against_a_hair_better_one():
    policy = SpecPolicy([7], PolicyKnobs(margin=0.05, gain=0.0))
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
    only a step that came after one of the same kind is measured as a step of its kind, the
    first as a switch (what it took beyond a steady step of its kind), and only when the next
    one is where it led (one step, not two, between)."""
    policy = SpecPolicy([3], PolicyKnobs(spec_steps=2, refresh=2, probe=2, check=2, lead=2))
    other = Pacer(policy, False)  # (the look of the bucket: 2 steps of another sequence)
    assert other.step(100, 1, 0, -2.0) == 0 and other.step(101, 1, 1, -1.0) == 0
    pacer = Pacer(policy, False)
    assert pacer.step(10, 1, 2, 0.0) == 0  # the rest of the first look: plain steps
    assert pacer.step(11, 1, 3, 1.0) == 0  # (the sequence's first step: not measured)
    assert policy.plain_time(1) is None
    assert pacer.step(12, 1, 4, 2.5) == 3  # then rounds; the second plain step took 1.5 s
    assert policy.plain_time(1) == pytest.approx(1.5)
    pacer.ran(3, 14, {3: 2})
    assert pacer.step(14, 1, 5, 5.0) == 3  # the first round (a switch) took 2.5 s
    assert policy.round_time(1, 3) is None and policy.switch_time(1) == 0.0  # (no round
    # measured yet to tell what the switch cost)
    pacer.ran(3, 16, {3: 2})
    assert pacer.step(16, 1, 6, 7.0) == 3  # decided: on; the second round took 2 s
    assert policy.round_time(1, 3) == pytest.approx(2.0) and policy.choice(1, False) == 3
    pacer.ran(3, 18, {3: 2})
    assert pacer.step(18, 1, 7, 9.5) == 3
    pacer.ran(3, 20, {3: 2})
    assert pacer.step(20, 1, 8, 11.0) == 0  # plain steps measured
    assert policy.round_time(1, 3) == pytest.approx(2.0)  # (the median of 2, 2.5, 1.5)
    assert pacer.step(21, 1, 9, 14.0) == 0  # the first plain step: 3 s, 1.5 s a switch
    assert policy.switch_time(1) == pytest.approx(1.5) and policy.plain_time(1) == 1.5
    pacer.step(23, 1, 10, 15.0)  # a position skipped: not one step
    assert policy.plain_time(1) == pytest.approx(1.5)


def test_a_round_after_a_round_of_another_size_is_a_round_not_a_switch():
    """A switch is between plain steps and rounds (the draft catching up, a proposal prepared
    for nothing); a round right after a round of another size (the draft was told that size)
    is timed as a round of its size, and adds nothing to the switch's price."""

    class Scripted(SpecPolicy):  # (the sizes of the steps given, not decided)
        def __init__(self, script):
            super().__init__([7, 3])
            self.script = iter(script)

        def plan(self, batch, sampled, clock):
            return next(self.script)

    policy = Scripted([0, 0, 7, 7, 7, 3, 3, 0, 0, 0])
    pacer = Pacer(policy, False)
    now, pos = 0.0, 0
    for clock, dt in enumerate([1.0, 1.0, 2.5, 2.0, 2.0, 1.5, 1.5, 1.5, 1.0, 1.0]):
        size = pacer.step(pos, 1, clock, now)
        if size:
            pacer.ran(size, pos + 2, {size: 2})
        pos += 2 if size else 1
        now += dt
    assert policy.plain_time(1) == pytest.approx(1.0)
    assert policy.round_time(1, 7) == pytest.approx(2.0)
    assert policy.round_time(1, 3) == pytest.approx(1.5)  # (both its rounds)
    assert policy._round[1, 3].count == 2
    assert policy.switch_time(1) == pytest.approx(0.5)  # (the first plain step after rounds;
    # the first round at 7 came before a steady one told what the switch cost)
    assert list(policy._switch[1].xs) == [pytest.approx(0.5)]


def test_a_batch_counts_each_step_once_and_a_pause_moves_no_estimate():
    """8 sequences of a batch report each step: it counts once. A step that paused (a graph
    captured, a collector) is one of the latest steps whose median is the estimate: it does not
    move it, where a moving average would price plain steps 10 x too high for a long while."""
    policy = SpecPolicy(TREE)
    for step in range(10):
        for _ in range(8):
            policy.observe_plain(8, 0.5 if step == 3 else 0.002, tag=step)
    assert policy.plain_time(8) == pytest.approx(0.002)
    assert policy._plain[8].count == 10


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



# ---- the two cases measured on an H200 (default model, its bundled draft, 1 shard) -------------
MS = 1e-3


def run_batch(policy, steps, seqs, t_plain, t_round, kept, switch=(0.0, 0.0), spikes=None,
              state=None, draft=0.0):
    """`seqs` sequences decoding in one batch, in lockstep: each step of the runtime is one
    step of every sequence, each reporting it through its own Pacer at the same clock (the
    policy's phases are shared, so they all plan the same size). A step takes `t_plain` or
    `t_round(s)` seconds, plus `switch[0]` for the first round after plain steps (the draft
    catching up) or `switch[1]` for the first plain step after rounds, plus `spikes(clock,
    size)` (a graph captured on first use, a collector's pause); a round keeps `kept(s, i)` draft
    tokens at the runtime's `i`-th round, of which it waited `draft` seconds for its proposal.
    Returns the sizes of the steps and the tokens a second over the run."""
    now, clock, pos, pacers, rounds = state or (0.0, 0, [0] * seqs,
                                                [Pacer(policy, False) for _ in range(seqs)], 0)
    sizes, t0, p0, last = [], now, sum(pos), None
    for _ in range(steps):
        planned = {p.step(pos[i], seqs, clock, now) for i, p in enumerate(pacers)}
        assert len(planned) == 1  # (one phase for the batch)
        size = planned.pop()
        if size:
            k = min(kept(size, rounds), size)
            rounds += 1
            for i, p in enumerate(pacers):
                p.ran(size, pos[i] + k + 1, committed_by_size(policy.sizes, size, list(range(k))),
                      draft)
                pos[i] += k + 1
            dt = t_round(size)
        else:
            pos = [q + 1 for q in pos]
            dt = t_plain
        if last is not None and bool(last) != bool(size):
            dt += switch[0] if size else switch[1]
        now += dt + (spikes(clock, size) if spikes else 0.0)
        last = size
        clock += 1
        sizes.append(size)
    if state is not None:
        state[:] = [now, clock, pos, pacers, rounds]
    return sizes, (sum(pos) - p0) / (now - t0)


def first_use(seen, paused):
    """A 40 ms graph capture the first time each size runs, and a 25 ms collector pause every
    300 steps, the first among the first look's plain steps (its seconds summed in
    `paused[0]`: plain decoding pays them too)."""
    def spike(clock, size):
        extra = 0.0 if size in seen else 40 * MS
        seen.add(size)
        if clock % 300 == 7:
            paused[0] += 25 * MS
            extra += 25 * MS
        return extra
    return spike


def plain_rate(seqs, t_plain, steps, paused):
    """Tokens a second of plain decoding over `steps` steps of `seqs` sequences, with the
    collector's pauses."""
    return seqs * steps / (steps * t_plain + paused[0])


def test_one_sequence_where_a_round_pays_less_than_plain_steps_goes_off_at_once_and_stays():
    """1 shard, greedy, one sequence: a plain step takes 0.78 ms; a round at the whole tree 2.47
    ms (0.31 ms waiting for the draft, the rest its verify step: rows cost little, a step's
    kernels much) and commits 2.67 tokens: 0.92 ms a token, 18 % slower than plain (smaller
    trees keep fewer and save little). Graph captures on first use and a collector's pauses
    land in some steps (one among the first plain steps measured), and every switch costs its
    first step a little more. The policy turns speculation off within 20 steps (6 plain steps,
    a look at the whole tree, one at the smallest, 6 plain steps), stays off, and probes rarely
    enough to cost under 2 %: once off, within 2 % of plain decoding."""
    policy = SpecPolicy(TREE)
    state, paused = [], [0.0]
    spikes = first_use(set(), paused)
    sizes, _ = run_batch(policy, 80, 1, 0.78 * MS, lambda s: (0.31 + 2.0 + 0.005 * s) * MS,
                         lambda s, i: 1 if s < 7 else 2 if i % 3 else 1, (0.5 * MS, 0.3 * MS),
                         spikes, state, 0.31 * MS)
    # a first look (plain steps, the whole tree), then a look at the smallest tree (priced
    # from a plain step plus the draft's wait up, a size never run looks cheaper than it is),
    # plain steps: off
    assert sizes[:LOOK + 14] == [0] * LOOK + [31] * 4 + [3] * 4 + [0] * 6
    assert set(sizes[LOOK + 14:]) == {0}
    assert policy.choice(1, False) == 0
    total, rate = run_batch(policy, 2320, 1, 0.78 * MS,
                            lambda s: (0.31 + 2.0 + 0.005 * s) * MS,
                            lambda s, i: 1 if s < 7 else 2 if i % 3 else 1, (0.5 * MS, 0.3 * MS),
                            spikes, state, 0.31 * MS)
    assert policy.choice(1, False) == 0
    assert sum(s > 0 for s in total) <= 4 * policy.stats.probes <= 4 * 4  # (probes only)
    paused[0] -= 25 * MS  # (the first look's)
    assert rate > 0.98 * plain_rate(1, 0.78 * MS, 2320, paused)


def test_eight_streams_with_a_slow_draft_go_off_at_once_and_stay():
    """8 streams, all speculating (spec_max_seqs 8): a plain step of the batch takes 1.6 ms; a
    round waits 4.4 ms for the draft's 8 proposals (every tenth 24 ms) and a verify step of 8
    trees (1.6 ms + 0.15 ms a draft token), and commits 2 tokens a sequence: at best (3 draft
    tokens) 2 x slower than plain decoding. Off at the first decision, after 3 rounds; over
    3,000 steps of the batch within 2 % of plain decoding once off."""
    policy = SpecPolicy(TREE, spec_seqs=8)

    def t_round(s):
        return (4.4 + 1.6 + 0.15 * s) * MS

    paused = [0.0]

    def spikes(clock, size, inner=first_use(set(), paused)):
        return inner(clock, size) + (20 * MS if size and clock % 10 == 0 else 0.0)

    state = []
    sizes, _ = run_batch(policy, LOOK + 34, 8, 1.6 * MS, t_round, lambda s, i: 1,
                         (2 * MS, 1 * MS), spikes, state, 4.4 * MS)
    # a first look: plain steps, then the whole tree, left after its second measured round
    # (even the fastest rounds, and a smaller tree priced from a plain step plus the draft's
    # wait up, are over 1.5 x slower than plain steps): off
    assert sizes == [0] * LOOK + [31] * 3 + [0] * 31 and policy.choice(8, False) == 0
    assert policy.stats.rounds == 8 * 3  # (each sequence planned each round)
    total, rate = run_batch(policy, 2920, 8, 1.6 * MS, t_round, lambda s, i: 1,
                            (2 * MS, 1 * MS), spikes, state, 4.4 * MS)
    assert policy.choice(8, False) == 0
    assert sum(s > 0 for s in total) <= 4 * policy.stats.probes <= 4 * 3
    paused[0] -= 25 * MS  # (the first look's)
    assert rate > 0.98 * plain_rate(8, 1.6 * MS, 2920, paused)


def test_a_run_of_losing_rounds_is_left_within_a_check_while_speculating():
    """Speculation pays (a large target: a round costs 1.15 plain steps and keeps 3 draft
    tokens), then the draft slows down 20 x (another process on its GPU): the policy leaves it
    at a check, within 2 x `check` rounds, not at the end of a phase."""
    policy = SpecPolicy(TREE, spec_seqs=8)
    state = []
    run_batch(policy, 440, 8, 10 * MS, lambda s: 11.5 * MS, lambda s, i: 3, state=state)
    assert policy.choice(8, False) > 0
    sizes, _ = run_batch(policy, 200, 8, 10 * MS, lambda s: 100 * MS, lambda s, i: 3,
                         state=state)
    assert policy.choice(8, False) == 0
    assert sum(s > 0 for s in sizes) <= 2 * policy.knobs.check


def test_where_speculation_wins_it_turns_on_at_every_batch_size():
    """A target whose verify steps cost little more than its plain steps (the sizes the draft
    is for): at 1 and at 8 streams speculation wins, and stays on but for the few plain steps
    that keep the plain price known; the spikes and switches do not turn it off."""
    for seqs, t_plain, t_round, kept in ((1, 10 * MS, 11.5 * MS, 5), (8, 12 * MS, 15 * MS, 4)):
        policy = SpecPolicy(TREE, spec_seqs=seqs)
        sizes, rate = run_batch(policy, 1500, seqs, t_plain, lambda s: t_round,
                                lambda s, i: kept, (3 * MS, 2 * MS),
                                first_use(set(), [0.0]))
        assert policy.choice(seqs, False) > 0
        assert sum(s > 0 for s in sizes[-1000:]) >= 900
        assert rate > 0.9 * seqs * (kept + 1) / t_round


def test_plain_steps_left_say_which_steps_may_park_their_rows():
    """`plain_left`: the plain steps the current phase plans from a clock on (what lets a step
    park its feature rows: the next step plain too), 0 in a phase that speculates; during a
    bucket's look, more than any lead of taps (its steps send the draft no rows)."""
    policy = SpecPolicy(TREE, PolicyKnobs(refresh=6, probe=4, lead=8))
    assert policy.plain_left(1, False, 0) == 0  # (nothing planned yet)
    pacer = Pacer(policy, False)
    assert pacer.step(0, 1, 0, 0.0) == 0  # a first look: 6 plain steps that send no rows
    assert policy.plain_left(1, False, 0) > 6 + 24 * 8  # (past the taps' lead at any pace)
    for c in range(1, 7):
        assert pacer.step(c, 1, c, c * 0.01) == 0  # then 8 that do
    assert [policy.plain_left(1, False, c) for c in range(6, 15)] == [8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert policy.plain_left(2, False, 0) == 0 and policy.plain_left(1, True, 0) == 0
    for c in range(7, 14):
        pacer.step(c, 1, c, c * 0.01)
    assert pacer.step(14, 1, 14, 0.14) == 31  # the probe at 14 speculates
    assert policy.plain_left(1, False, 14) == 0


def test_a_probe_priced_from_a_smaller_batch_as_futile_is_skipped():
    """2 shards, 8 streams, one of them speculating (spec_max_seqs 1), as measured on an H200:
    alone, a sequence's round takes 3 ms more than its plain step (1.1 ms) and keeps 2 draft
    tokens, so speculation went off there. In the batch of 8 (a plain step 2.5 ms), a round
    would commit 7 + 3 tokens for at least 2.5 + 3 ms: no probe is run for it (each one costs
    its rounds, its switches and the taps before it), the off phases double as if probes had
    lost, and once they reach `off_steps_max` a probe runs all the same (the price is a prior)."""
    policy = SpecPolicy(TREE)
    run_batch(policy, 200, 1, 1.1 * MS, lambda s: (4.0 + 0.003 * s) * MS, lambda s, i: 2)
    assert policy.choice(1, False) == 0
    assert policy.prior_rates(8, False) == {}  # (its plain step not measured yet)
    state = []
    sizes, rate = run_batch(policy, 3000, 8, 2.5 * MS, lambda s: 9.5 * MS, lambda s, i: 2,
                            state=state)
    assert set(sizes) == {0} and policy.choice(8, False) == 0
    assert policy.stats.skipped >= 6  # (the first look's, then off phases of 48, 96, ... 1536)
    prior = policy.prior_rates(8, False)
    assert prior[0] == pytest.approx(8 / (2.5 * MS))
    assert max(r for s, r in prior.items() if s) < prior[0]
    assert rate == pytest.approx(8 / (2.5 * MS))  # (plain decoding's own)
    # the steps before a probe that will be skipped need not send the draft rows: plain steps
    # left run past the phase's end
    end = policy._phase[(8, False)].end
    assert policy.plain_left(8, False, end - 300) == 300
    assert policy.plain_left(8, False, end - 5) >= 5 + policy.knobs.off_steps
    probes = policy.stats.probes
    sizes, _ = run_batch(policy, 20000, 8, 2.5 * MS, lambda s: 9.5 * MS, lambda s, i: 2,
                         state=state)
    assert policy.stats.probes > probes and 0 < sum(s > 0 for s in sizes) <= 8  # (at 8192)
    assert policy.choice(8, False) == 0


def test_a_probe_priced_from_a_smaller_batch_as_worth_it_runs():
    """Where rounds alone cost little beyond a plain step (a large target), the bucket of 8
    probes after its first look as ever: the prior only skips probes it prices as losing."""
    policy = SpecPolicy(TREE)
    run_batch(policy, 200, 1, 10 * MS, lambda s: 11 * MS, lambda s, i: 4)
    assert policy.choice(1, False) > 0
    sizes, _ = run_batch(policy, LOOK + 40, 8, 12 * MS, lambda s: 14 * MS, lambda s, i: 4)
    assert sizes[LOOK:LOOK + 2] == [31, 31] and policy.stats.skipped == 0
    assert policy.prior_rates(8, False) == {}  # (its own rounds measured now)


LEAD = 40  # (`runtime.speculative`: TAP_LEAD + RESTART_ROWS)


def run_tapping(policy, steps, seqs, t_plain, t_tap, t_round, kept, state=None, report=True):
    """`run_batch` where a plain step sends the draft its rows (costing `t_tap` more) within
    `LEAD` steps of a round (as `runtime.speculative.DraftClient.taps` has it: the
    steps before a probe, a phase's refresh) and not further from one; each untapped step
    reported to the sequences' Pacers (`report`) as the runtime does."""
    now, clock, pos, pacers = state or (0.0, 0, [0] * seqs,
                                        [Pacer(policy, False) for _ in range(seqs)])
    sizes, t0, p0 = [], now, sum(pos)
    for _ in range(steps):
        size = {p.step(pos[i], seqs, clock, now) for i, p in enumerate(pacers)}.pop()
        if size:
            k = min(kept, size)
            for i, p in enumerate(pacers):
                p.ran(size, pos[i] + k + 1, committed_by_size(policy.sizes, size,
                                                              list(range(k))))
                pos[i] += k + 1
            now += t_round
        else:
            tapped = policy.plain_left(seqs, False, clock) <= LEAD
            for i, p in enumerate(pacers):
                if not tapped and report:
                    p.untapped(pos[i])
                pos[i] += 1
            now += t_plain + (t_tap if tapped else 0.0)
        clock += 1
        sizes.append(size)
    if state is not None:
        state[:] = [now, clock, pos, pacers]
    return sizes, (sum(pos) - p0) / (now - t0)


def test_plain_steps_that_feed_the_draft_are_priced_apart_and_a_probe_pays_for_its_lead():
    """8 streams on 2 shards, all speculating, as measured on an H200: a plain step of the batch
    takes 2.4 ms when it sends the draft no rows, 4.0 ms when it does (the 40 steps before a
    probe, the plain steps of a refresh); a round takes 9.5 ms and keeps 2 draft tokens a
    sequence. Priced by the steps that feed the draft, plain decoding looked 40 % dearer than it
    is, and a probe cost its lead's extra 64 ms beyond its rounds. The policy prices plain
    steps by the untapped ones (its first look measures some) and a probe with its lead: over
    6,000 steps within 1.5 % of plain decoding; with plain steps priced by every one measured
    (none told apart, no lead), the refreshes' tapped steps made speculating look faster, and
    it speculated throughout, 25 % slower."""
    rates = {}
    for told in (True, False):
        policy = SpecPolicy(TREE, PolicyKnobs() if told else PolicyKnobs(lead=0), spec_seqs=8)
        _, rates[told] = run_tapping(policy, 6000, 8, 2.4 * MS, 1.6 * MS, 9.5 * MS, 2,
                                     report=told)
        if told:
            assert policy.choice(8, False) == 0
            assert policy.plain_time(8) == pytest.approx(2.4 * MS)
            assert policy.tap_time(8) == pytest.approx(1.6 * MS)
            probes = policy.stats.probes
    plain_rate = 8 / (2.4 * MS)
    assert rates[True] > 0.985 * plain_rate and probes <= 3
    assert rates[False] < 0.8 * plain_rate  # (speculating all along: plain looked dearer)


def test_a_probe_is_priced_with_the_rows_its_lead_sends():
    """`probe_loss`: a probe's rounds and switches beyond plain steps, plus `lead` times what a
    plain step that feeds the draft costs beyond one that does not."""
    policy = SpecPolicy(TREE, PolicyKnobs(lead=40))
    for i in range(6):
        policy.observe_plain(1, 1.5 * MS, tag=i)
        policy.observe_plain(1, 1.0 * MS, tag=100 + i, untapped=True)
        policy.observe_round(1, 31, 3.0 * MS, tag=200 + i)
    policy.observe_kept(False, {31: 2})
    assert policy.plain_time(1) == pytest.approx(1.0 * MS)  # (the untapped steps')
    assert policy.tap_time(1) == pytest.approx(0.5 * MS)
    loss = policy.knobs.probe * (3.0 - 2 * 1.0) * MS + 40 * 0.5 * MS
    assert policy.probe_loss(1, False) == pytest.approx(loss)


def test_a_pacer_measures_untapped_plain_steps_apart():
    """A plain step whose position was reported untapped is measured as plain decoding's own
    (`plain_time`); the others as plain steps that feed the draft (`tap_time`: their extra)."""
    policy = SpecPolicy([3])
    pacer = Pacer(policy, False)
    pacer.step(0, 1, 0, 0.0)
    pacer.untapped(0)
    pacer.step(1, 1, 1, 1.0)  # (a sequence's first step: not measured)
    pacer.untapped(1)
    pacer.step(2, 1, 2, 2.0)  # step 1, untapped: 1 s
    pacer.step(3, 1, 3, 4.5)  # step 2, tapped: 2.5 s
    assert policy.plain_time(1) == pytest.approx(1.0)
    assert policy.tap_time(1) == pytest.approx(1.5)


def test_a_probe_judged_futile_by_plain_left_is_skipped_even_where_the_prior_moved():
    """`plain_left` judges once, within `PLAIN_LOOK` steps of an off phase's end, that its
    probe will be skipped, and the runtime then sends the draft no rows up to that end. Plain
    steps measured meanwhile (dearer: a longer context) may move the prior; the probe at the
    end must still be skipped, else it runs with no rows before it (its rounds run plain)."""
    policy = SpecPolicy(TREE)
    run_batch(policy, 200, 1, 1.1 * MS, lambda s: (4.0 + 0.003 * s) * MS, lambda s, i: 2)
    state = []
    run_batch(policy, 600, 8, 2.5 * MS, lambda s: 9.5 * MS, lambda s, i: 2, state=state)
    ph = policy._phase[(8, False)]
    assert ph.kind == "off"
    end = ph.end
    assert policy.plain_left(8, False, end - 5) >= 5 + policy.knobs.off_steps  # (futile)
    for i in range(policy.knobs.window):  # the last steps before the end cost 20 ms
        policy.observe_plain(8, 20 * MS, tag=10**6 + i, untapped=True)
    assert policy.plan(8, False, end) == 0  # (no rows went: no probe)


def test_refresh_steps_move_the_plain_price_when_the_first_look_is_stale():
    """A bucket's first look prices plain steps (2.4 ms, untapped); while speculation wins,
    only a refresh's plain steps measure plain decoding again, and those feed the draft. Where
    plain steps get cheaper (1.0 ms untapped, 1.2 ms tapped; a round still 5 ms for 3 tokens),
    speculating loses, and the refreshes show it: the policy must turn off, not price plain
    steps by the first look's forever."""
    policy = SpecPolicy(TREE, spec_seqs=1)
    state = []
    sizes, _ = run_tapping(policy, 400, 1, 2.4 * MS, 0.2 * MS, 5.0 * MS, 2, state=state)
    assert policy.choice(1, False) > 0  # (speculating wins against 2.4 ms)
    sizes, _ = run_tapping(policy, 2000, 1, 1.0 * MS, 0.2 * MS, 5.0 * MS, 2, state=state)
    assert policy.choice(1, False) == 0
    assert sum(s == 0 for s in sizes[-1000:]) >= 950


def test_a_switch_to_plain_steps_is_measured_against_plain_steps_that_sent_rows_as_it_did():
    """The first plain step after rounds usually sends the draft rows (a refresh's): what it
    took beyond a plain step that sends rows is the switch, not beyond plain decoding's own
    (that would count each switch the rows' cost over again)."""
    for untapped, switch in ((False, 0.5), (True, 1.5)):
        policy = SpecPolicy([3])
        for i in range(3):
            policy.observe_plain(1, 2.0, tag=i)
            policy.observe_plain(1, 1.0, tag=10 + i, untapped=True)
        policy.observe_switch(1, 0, 2.5, tag=20, untapped=untapped)
        assert policy.switch_time(1) == pytest.approx(switch)
