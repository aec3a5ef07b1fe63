"""Whether a step speculates, and with how many draft tokens (`spec_policy`): pure logic fed with
measurements, no processes and no tensors, so its tests run on a faked cost model.

What it measures, online, for this runtime's layout (one policy per runtime) and per batch-size
bucket (1, 2, 3-4, 5-8, ... sequences decoding):
- `t_plain(b)`: seconds from one of a sequence's plain decode steps to its next;
- `t_round(s, b)`: the same for verify rounds proposing `s` draft tokens (a round is the draft's
  proposal and the verify step, as the sequence sees them);
- `a(s)`: tokens a round commits (kept draft tokens + the target's own), an exponential moving
  average, for greedy and sampled requests apart. Every candidate size is learnt from each
  round at once: a round that verified `s` draft tokens also tells what a smaller tree (the
  first paths of the draft's tree shape, every prefix of which is a tree) or a shorter chain
  would have kept, since the target's token at each position does not depend on the tree.

Speculating at size `s` yields `a(s) / t_round(s, b)` tokens a second per sequence; plain
decoding `1 / t_plain(b)`. A batch of `b` where only `k` sequences speculate (`spec_max_seqs`)
weighs the others too, whose steps the verify rows slow: `(b - k + k a(s)) / t_round(s, b)`
against `b / t_plain(b)`. The policy runs in phases counted in steps of the runtime's clock (steps
sent): it speculates at the best size for `spec_steps` steps, then decodes `refresh` plain
steps (the plain cost drifts with the batch and the context); turned off, it decodes plainly
for `off_steps` steps (doubling, up to `off_steps_max`, while probes keep losing), then probes
`probe` rounds at the largest size (whose rounds teach every size's acceptance). After a
refresh or a probe it decides: the best of plain and every size, but it leaves the current
choice only for one `margin` better. A size whose round time was never measured is priced by
linear interpolation between the plain step and the measured sizes around it: an optimistic
price (it leaves out a round's fixed cost), so an unmeasured smaller size is tried for `probe`
rounds, then priced as measured; every fourth decision for a smaller size first runs `probe`
rounds at the largest (the only rounds that teach the larger sizes' acceptance).

`spec_policy = on` never consults it: every step that can speculate does (for benchmarks and
tests of speculation itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyKnobs:
    """The policy's constants (steps are the runtime's steps sent)."""

    alpha: float = 0.15  # weight of a new measurement in the moving averages
    margin: float = 0.03  # a choice is replaced only by one this much faster
    spec_steps: int = 96  # steps speculating before `refresh` plain steps
    refresh: int = 4  # plain steps measured between speculating phases (the first is not)
    off_steps: int = 48  # plain steps before a probe, after a first decision for plain
    off_steps_max: int = 768  # ... doubling while probes lose, up to this
    probe: int = 5  # rounds of a probe at the largest size (the first is not measured)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0 or self.margin < 0.0:
            raise ValueError(f"policy knobs: alpha {self.alpha} must be in (0, 1], margin "
                             f"{self.margin} at least 0")
        if min(self.spec_steps, self.refresh, self.off_steps, self.probe) < 2 or \
                self.off_steps_max < self.off_steps:
            raise ValueError("policy knobs: every phase needs at least 2 steps (the first of "
                             "a phase is not measured), and off_steps_max >= off_steps")


def bucket(batch: int) -> int:
    """The batch-size bucket of `batch` sequences decoding: 1, 2, 4, 8, ... (the next power of
    two; a step of 5 sequences costs about what one of 8 does, not what one of 2 does)."""
    b = 1
    while b < batch:
        b *= 2
    return b


class Ema:
    """An exponential moving average (None until its first value)."""

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.count = alpha, None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.count += 1


@dataclasses.dataclass(slots=True)
class Phase:
    kind: str  # spec, refresh (plain steps measured), off, probe
    size: int  # draft tokens of its rounds (0: plain steps)
    end: int  # the clock at which it ends


@dataclasses.dataclass(slots=True)
class PolicyStats:
    """What the policy chose (summed over its decisions; `/metrics`)."""

    rounds: int = 0  # steps planned to speculate
    off_steps: int = 0  # steps planned plain (off, or measuring plain steps)
    probes: int = 0  # probes begun (speculation tried while off)
    switches: int = 0  # decisions that changed the size or turned speculation on or off
    size: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> chosen size
    # (0: off) after its last decision


class SpecPolicy:
    """The choice of each step: `plan` (draft tokens, 0 for a plain step); fed with
    `observe_plain`, `observe_round` and `observe_kept`."""

    def __init__(self, sizes: Sequence[int], knobs: PolicyKnobs | None = None,
                 spec_seqs: int = 1) -> None:
        """`sizes`: the draft token counts a step may propose (tree sizes that are prefixes of
        the draft's tree, or chain depths), any order; the largest is where speculation starts
        and what probes run. `spec_seqs`: the sequences of a batch that may speculate at once
        (`spec_max_seqs`): the others decode plainly in the same steps, and a verify step's
        rows slow them too, so a batch's speed is weighed, not one sequence's."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"speculation policy: sizes {list(sizes)} must be >= 1")
        self.sizes = sorted(set(sizes), reverse=True)
        self.spec_seqs = max(1, spec_seqs)
        self.knobs = knobs or PolicyKnobs()
        self.stats = PolicyStats()
        self._plain: dict[int, Ema] = {}  # bucket -> seconds per plain step
        self._round: dict[tuple[int, int], Ema] = {}  # (bucket, size) -> seconds per round
        self._kept: dict[tuple[bool, int], Ema] = {}  # (sampled, size) -> tokens per round
        self._phase: dict[tuple[int, bool], Phase] = {}
        self._choice: dict[tuple[int, bool], int] = {}  # (bucket, sampled) -> size, 0: off
        self._off_len: dict[tuple[int, bool], int] = {}
        self._decisions: dict[tuple[int, bool], int] = {}

    @property
    def largest(self) -> int:
        return self.sizes[0]

    # ---- measurements ---------------------------------------------------------------------------
    def observe_plain(self, batch: int, seconds: float) -> None:
        """A sequence's plain decode step took `seconds` (from its last step to this one)."""
        self._plain.setdefault(bucket(batch), Ema(self.knobs.alpha)).add(seconds)

    def observe_round(self, batch: int, size: int, seconds: float) -> None:
        """A round proposing `size` draft tokens took `seconds`."""
        self._round.setdefault((bucket(batch), size), Ema(self.knobs.alpha)).add(seconds)

    def observe_kept(self, sampled: bool, committed: Mapping[int, int]) -> None:
        """A round committed `committed[s]` tokens, or would have with `s` draft tokens (every
        candidate size up to the one it ran)."""
        for size, n in committed.items():
            if size in self.sizes:
                self._kept.setdefault((sampled, size), Ema(self.knobs.alpha)).add(float(n))

    # ---- estimates ------------------------------------------------------------------------------
    def plain_time(self, batch: int) -> float | None:
        e = self._plain.get(bucket(batch))
        return None if e is None else e.value

    def round_time(self, batch: int, size: int) -> float | None:
        """Measured, else interpolated between the plain step (size 0) and the measured sizes
        around `size` (beyond the largest measured one: that one's)."""
        b = bucket(batch)
        e = self._round.get((b, size))
        if e is not None:
            return e.value
        known = sorted((s, e.value) for (bb, s), e in self._round.items() if bb == b)
        plain = self.plain_time(batch)
        lo = (0, plain) if plain is not None else None
        for s, t in known:
            if s < size:
                lo = (s, t)
            else:
                if lo is None:
                    return t
                return lo[1] + (t - lo[1]) * (size - lo[0]) / (s - lo[0])
        return known[-1][1] if known else None

    def kept(self, sampled: bool, size: int) -> float | None:
        e = self._kept.get((sampled, size))
        return None if e is None else e.value

    def rates(self, batch: int, sampled: bool) -> dict[int, float]:
        """Estimated tokens a second of a batch of `batch` sequences (its bucket's size), `k`
        of them speculating (`spec_seqs`, at most all): {0: plain, b / t_plain; size: speculating
        at that size, (b - k + k a(size)) / t_round(size)}, for those that can be estimated."""
        b = bucket(batch)
        k = min(self.spec_seqs, b)
        out = {}
        plain = self.plain_time(batch)
        if plain is not None and plain > 0:
            out[0] = b / plain
        for s in self.sizes:
            a, t = self.kept(sampled, s), self.round_time(batch, s)
            if a is not None and t is not None and t > 0:
                out[s] = (b - k + k * a) / t
        return out

    def decide(self, batch: int, sampled: bool, current: int) -> int:
        """The best size (0: plain) by the estimates; `current` stays unless beaten by
        `margin` (or cannot be estimated)."""
        rates = self.rates(batch, sampled)
        if not rates:
            return current
        best = max(rates, key=lambda s: (rates[s], -s))
        mine = rates.get(current)
        if mine is not None and rates[best] <= mine * (1.0 + self.knobs.margin):
            return current
        return best

    # ---- the plan -------------------------------------------------------------------------------
    def plan(self, batch: int, sampled: bool, clock: int) -> int:
        """Draft tokens the step of a sequence about to go out at `clock` (steps sent so far)
        proposes: 0 for a plain step."""
        key = (bucket(batch), sampled)
        ph = self._phase.get(key)
        if ph is None:  # a first look: speculate as configured, then measure plain
            ph = self._phase[key] = Phase("spec", self.largest, clock + self.knobs.probe)
            self._choice[key] = self.largest
        while clock >= ph.end:
            ph = self._phase[key] = self._next(key, ph, batch, sampled, clock)
        if ph.size:
            self.stats.rounds += 1
        else:
            self.stats.off_steps += 1
        return ph.size

    def _next(self, key: tuple[int, bool], ph: Phase, batch: int, sampled: bool,
              clock: int) -> Phase:
        k = self.knobs
        if ph.kind == "spec":
            return Phase("refresh", 0, clock + k.refresh)
        if ph.kind == "off":
            self.stats.probes += 1
            return Phase("probe", self.largest, clock + k.probe)
        # after a refresh or a probe: decide
        was = self._choice.get(key, self.largest)
        now = self.decide(batch, sampled, was if ph.kind == "refresh" else 0)
        self._choice[key] = now
        self.stats.size[key[0]] = now
        self._decisions[key] = n = self._decisions.get(key, 0) + 1
        if now != was:
            self.stats.switches += 1
        if now == 0:
            off = self._off_len.get(key)
            off = k.off_steps if off is None or was else min(2 * off, k.off_steps_max)
            self._off_len[key] = off
            return Phase("off", 0, clock + off)
        self._off_len.pop(key, None)
        if (key[0], now) not in self._round:  # priced, not measured: a short look first
            return Phase("spec", now, clock + k.probe)
        if now != self.largest and n % 4 == 0:  # the larger sizes' acceptance, now and then
            return Phase("spec", self.largest, clock + k.probe)
        return Phase("spec", now, clock + k.spec_steps)

    def choice(self, batch: int, sampled: bool) -> int | None:
        """The size last decided for this bucket (0: off; None: not decided yet)."""
        return self._choice.get((bucket(batch), sampled))


def committed_by_size(sizes: Sequence[int], ran: int, ranks: Sequence[int]) -> dict[int, int]:
    """Tokens a round that verified `ran` draft tokens and kept the rows whose priorities are
    `ranks` (in path order: each kept row's index in the draft's tree shape, or its depth - 1
    for a chain) would have committed with each candidate size up to `ran`: the kept path up to
    its first row a smaller tree or chain leaves out, plus the target's token."""
    out = {}
    for s in sizes:
        if s <= ran:
            n = next((i for i, r in enumerate(ranks) if r >= s), len(ranks))
            out[s] = n + 1
    return out


def policy_sizes(full: int) -> list[int]:
    """Candidate draft token counts below `full` (a tree's nodes or a chain's depth): `full`,
    then halving (31: 31, 15, 7, 3; a chain of 7: 7, 3, 1)."""
    out = [full]
    while out[-1] // 2 >= (1 if full < 8 else 3):
        out.append(out[-1] // 2)
    return out


def tree_ranks(shape: Sequence[Sequence[int]], nodes: int, depth: int) -> list[int]:
    """For a proposal of the first `nodes` paths of a tree `shape` no deeper than `depth`
    (`draft.tree_shape.instantiate`: rows in depth-first order), each draft row's priority
    (its path's index among those paths): a tree of the first k paths holds the rows whose
    priority is below k."""
    paths = [tuple(p) for p in shape if len(p) <= depth][:nodes]
    order = {p: i for i, p in enumerate(paths)}
    return [order[p] for p in sorted(paths)]


class Pacer:
    """One sequence's side of the policy: the size of each of its steps (`step`, or planned a
    step ahead with `plan_next` when the draft is told what to prepare), and the time from each
    step to the next, given to the policy as that step's cost when it was a steady one: it came
    right after a step of the same size (the first step of a kind pays for the switch: kept
    rows moved, the draft's context caught up) and the next step is at the position it led to
    (one step, not two, lies between)."""

    def __init__(self, policy: SpecPolicy, sampled: bool) -> None:
        self.policy, self.sampled = policy, sampled
        self._told: int | None = None  # the size already planned for the next step
        self._last: list | None = None  # [size, start, batch, position the next step is at]
        self._before: int | None = None  # the size of the step before the last

    def step(self, pos: int, batch: int, clock: int, now: float) -> int:
        """The size of the step at `pos` (0: plain), planned at `clock` with `batch` sequences
        decoding, `now` on a monotonic clock."""
        if self._last is not None:
            size, start, b, expect = self._last
            if expect == pos and self._before == size >= 0:
                if size:
                    self.policy.observe_round(b, size, now - start)
                else:
                    self.policy.observe_plain(b, now - start)
            self._before = size
        size = self._told if self._told is not None else self.policy.plan(
            batch, self.sampled, clock)
        self._told = None
        self._last = [size, now, batch, pos + 1 if size == 0 else None]
        return size

    @property
    def told(self) -> int | None:
        """The size planned ahead for the next step (None: not planned yet)."""
        return self._told

    def plan_next(self, batch: int, clock: int) -> int:
        """The size of the step after this one, decided now (the draft prepares it)."""
        self._told = self.policy.plan(batch, self.sampled, clock)
        return self._told

    def ran(self, size: int, next_pos: int, committed: Mapping[int, int]) -> None:
        """The round planned at the last `step` verified `size` draft tokens and the next step
        is at `next_pos`; `committed`: `committed_by_size`."""
        if self._last is not None and self._last[0] == size:
            self._last[3] = next_pos
        self.policy.observe_kept(self.sampled, committed)

    def missed(self) -> None:
        """The step planned as a round ran plain (no proposal came): not measured."""
        if self._last is not None:
            self._last[0] = -1
