"""Whether a step speculates, and with how many draft tokens (`spec_policy`): pure logic fed with
measurements, no processes and no tensors, so its tests run on a faked cost model.

What it measures, online, for this runtime's layout (one policy per runtime) and per batch-size
bucket (1, 2, 3-4, 5-8, ... sequences decoding):
- `t_plain(b)`: seconds from one of a sequence's plain decode steps to its next;
- `t_round(s, b)`: the same for verify rounds proposing `s` draft tokens (a round is the draft's
  proposal, the kept rows' moves and the verify step, as the sequence sees them);
- `t_switch(b)`: what the first step of a kind (a round after plain steps, a plain step after
  rounds) takes beyond a steady step of its kind: the draft catching up on the rows of the
  plain steps, a proposal prepared for nothing; each phase of speculation pays it twice;
- `a(s)`: tokens a round commits (kept draft tokens + the target's own), an exponential moving
  average, for greedy and sampled requests apart. Every candidate size is learnt from each
  round at once: a round that verified `s` draft tokens also tells what a smaller tree (the
  first paths of the draft's tree shape, every prefix of which is a tree) or a shorter chain
  would have kept, since the target's token at each position does not depend on the tree.

A time is the median of its latest `window` measurements, one per step of the runtime (the
sequences of a batch report the same step: the first report counts), not a mean: a step that
captured a graph, compiled, or waited on the garbage collector moves it no more than any other
step, where in a moving average one such step would price plain decoding (measured only a few
steps at a time while speculation runs) wrong for hundreds of steps.

Speculating at size `s` yields `a(s) / (t_round(s, b) + 2 t_switch(b) / n)` tokens a second per
sequence over a phase of `n` rounds; plain decoding `1 / t_plain(b)`. A batch of `b` where only
`k` sequences speculate (`spec_max_seqs`) weighs the others too, whose steps the verify rows
slow: `b - k + k a(s)` tokens a round against `b` a plain step. Speculation is chosen (or kept)
only where it beats plain decoding by `gain`: at a tie plain steps are the safe choice (a round's
time varies more than a plain step's, and what it costs the steps around it is priced only as
far as the switches show it).

The policy runs in phases counted in steps of the runtime's clock (steps sent). A first look at a
batch bucket measures `refresh` plain steps that send the draft no rows (`look`: what plain steps
cost with speculation off; one that feeds the draft costs more: 4.0 against 2.4 ms for 8 streams
on 2 shards of an H200, where plain steps priced by those made speculating look faster than plain
decoding), then `lead` that do (the probe's draft reads their rows), then probes. Plain decoding
is priced by the untapped steps once measured (`plain_time`), and a probe with the tapped steps of
its lead (`probe_loss`). A probe runs `probe` rounds at the largest
size (whose rounds teach every size's acceptance), ended after two measured rounds where even its
fastest rounds make speculating at that size `abandon` times slower than plain steps (so is a
look at a size never measured, below); it decides on its own
rounds at the largest size (those timed before its off phase are forgotten where it timed two: a
window of stale ones would outvote a probe's few for good). Speculating, it decides again every
`check` rounds on the rounds just measured (a size that loses is left within two checks, once half
its window is slow, not at the end of a phase), and after `spec_steps` decodes `refresh` plain steps
(the plain cost drifts with the batch and the context). Turned off, it decodes plainly, then probes:
the plain steps before a probe are at least `off_steps` (doubling, up to `off_steps_max`, while
probes keep losing) and enough that what a probe loses against plain steps (its rounds and switches,
as last measured) is at most `probe_budget` of their time; a probe of a bucket whose own rounds
were never measured is skipped (the off phase doubling as after a losing one, up to
`off_steps_max`, where a probe runs all the same) where rounds priced from smaller buckets
(`prior_rates`: this bucket's plain step plus the least a smaller bucket's rounds took beyond
its plain step) lose. After a probe, a refresh or a check it
decides: the best of plain and every size, but it leaves the current choice only for one `margin`
better. A size whose round time was never measured is priced by linear interpolation between a plain
step plus the draft's wait (`t_draft(b)`, the median time a round waited for its proposal: what a
round of any size pays) and the measured sizes around it: an optimistic price (it leaves out the
rest of a round's fixed cost), so an unmeasured smaller size is tried for `probe` rounds (left
early where hopeless, as a probe is), then priced as measured; every fourth decision after a
refresh or a probe for a smaller size first runs `probe` rounds at the largest (the only rounds
that teach the larger sizes' acceptance).

`spec_policy = on` never consults it: every step that can speculate does (for benchmarks and
tests of speculation itself).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)


PLAIN_LOOK = 256  # `plain_left` judges whether the probe ending an off phase will be skipped
# within this many steps of it (a sequence's taps lead a probe by up to 24 of its own steps, up to
# 8 runtime steps each)


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyKnobs:
    """The policy's constants (steps are the runtime's steps sent)."""

    alpha: float = 0.15  # weight of a new measurement in the acceptance's moving average
    window: int = 24  # steps a time is the median of (the latest)
    margin: float = 0.03  # a choice is replaced only by one this much faster
    gain: float = 0.05  # speculation is chosen only where it is this much faster than plain
    check: int = 16  # rounds between decisions while speculating
    spec_steps: int = 96  # steps speculating before `refresh` plain steps
    refresh: int = 6  # plain steps measured between speculating phases (the first is not)
    off_steps: int = 48  # plain steps before a probe, after a first decision for plain
    off_steps_max: int = 8192  # ... doubling while probes lose, up to this
    probe: int = 4  # rounds of a probe at the largest size (the first is not measured)
    abandon: float = 1.5  # a probe (or a look at a size) ends after two measured rounds where
    # speculating at its size is, at its fastest, this many times slower than plain decoding
    probe_budget: float = 0.01  # a losing probe costs at most this share of the plain steps
    # before it
    lead: int = 40  # a sequence's plain steps before a probe that send the draft their rows
    # (`runtime.speculative`: TAP_LEAD, then RESTART_ROWS before its first round), a probe's cost

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0 or min(self.margin, self.gain) < 0.0 or \
                not 0.0 < self.probe_budget <= 1.0 or self.window < 1 or self.abandon < 1.0:
            raise ValueError(f"policy knobs: alpha {self.alpha} and probe_budget "
                             f"{self.probe_budget} must be in (0, 1], margin {self.margin} and "
                             f"gain {self.gain} at least 0, window {self.window} and abandon "
                             f"{self.abandon} at least 1")
        if min(self.spec_steps, self.refresh, self.off_steps, self.probe, self.check) < 2 or \
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


class Window:
    """The median of the latest `size` measurements (None until the first), one per `tag` (the
    runtime's step: a batch's sequences each report it, and only the first report counts)."""

    __slots__ = ("xs", "tags", "tag", "_median")

    def __init__(self, size: int) -> None:
        self.xs: deque[float] = deque(maxlen=size)
        self.tags: deque[int | None] = deque(maxlen=size)
        self.tag: int | None = None
        self._median: float | None = None

    def add(self, x: float, tag: int | None = None) -> None:
        if tag is not None and tag == self.tag:
            return
        self.tag = tag
        self.xs.append(x)
        self.tags.append(tag)
        self._median = None

    def keep_since(self, tag: int, least: int = 2) -> None:
        """Forget the measurements tagged before `tag` where at least `least` are not."""
        keep = [(x, t) for x, t in zip(self.xs, self.tags) if t is not None and t >= tag]
        if least <= len(keep) < len(self.xs):
            self.xs = deque((x for x, _ in keep), maxlen=self.xs.maxlen)
            self.tags = deque((t for _, t in keep), maxlen=self.tags.maxlen)
            self._median = None

    @property
    def count(self) -> int:
        return len(self.xs)

    @property
    def low(self) -> float | None:
        return min(self.xs) if self.xs else None

    @property
    def value(self) -> float | None:
        if self._median is None and self.xs:
            self._median = statistics.median(self.xs)
        return self._median


@dataclasses.dataclass(slots=True)
class Phase:
    kind: str  # look (a bucket's first plain steps, sending the draft no rows: plain
    # decoding's own, measured), first (plain steps that send rows, measured), spec, refresh
    # (plain steps measured), off, probe
    size: int  # draft tokens of its rounds (0: plain steps)
    end: int  # the clock at which it ends
    left: int = 0  # (spec) steps speculating after this one before a refresh: decided again
    # at `end` while some are left
    start: int = 0  # (probe, trial) the clock it began at
    trial: bool = False  # (spec) a short look at a size (`probe` rounds), left early, as a
    # probe is, once hopeless
    futile: bool | None = None  # (off, first) whether the probe at its end will be skipped,
    # as `plain_left` last judged it (None: not yet)


@dataclasses.dataclass(slots=True)
class PolicyStats:
    """What the policy chose (summed over its decisions; `/metrics`)."""

    rounds: int = 0  # steps planned to speculate
    off_steps: int = 0  # steps planned plain (off, or measuring plain steps)
    probes: int = 0  # probes begun (speculation tried while off)
    skipped: int = 0  # probes not begun: priced from smaller batches' rounds, futile
    switches: int = 0  # decisions that changed the size or turned speculation on or off
    size: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> chosen size
    # (0: off) after its last decision


class SpecPolicy:
    """The choice of each step: `plan` (draft tokens, 0 for a plain step); fed with
    `observe_plain`, `observe_round`, `observe_switch` and `observe_kept`."""

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
        self._plain: dict[int, Window] = {}  # bucket -> seconds per plain step (that sent
        # the draft its rows: next to rounds, before a probe)
        self._untapped: dict[int, Window] = {}  # ... per plain step that sent none (plain
        # decoding's own, `runtime.speculative.DraftClient.taps`)
        self._round: dict[tuple[int, int], Window] = {}  # (bucket, size) -> seconds per round
        self._switch: dict[int, Window] = {}  # bucket -> seconds a switch adds to its step
        self._draft: dict[int, Window] = {}  # bucket -> seconds a round waits for its proposal
        self._kept: dict[tuple[bool, int], Ema] = {}  # (sampled, size) -> tokens per round
        self._phase: dict[tuple[int, bool], Phase] = {}
        self._choice: dict[tuple[int, bool], int] = {}  # (bucket, sampled) -> size, 0: off
        self._off_len: dict[tuple[int, bool], int] = {}
        self._decisions: dict[tuple[int, bool], int] = {}

    @property
    def largest(self) -> int:
        return self.sizes[0]

    # ---- measurements ---------------------------------------------------------------------------
    def _window(self, table: dict, key) -> Window:
        w = table.get(key)
        if w is None:
            w = table[key] = Window(self.knobs.window)
        return w

    def observe_plain(self, batch: int, seconds: float, tag: int | None = None,
                      untapped: bool = False) -> None:
        """A sequence's plain decode step took `seconds` (from its last step to this one);
        `tag`: the runtime's step it measured (one measurement counts per step); `untapped`:
        it sent the draft no rows (what a plain step costs with speculation off)."""
        self._window(self._untapped if untapped else self._plain, bucket(batch)).add(
            seconds, tag)

    def observe_round(self, batch: int, size: int, seconds: float,
                      tag: int | None = None) -> None:
        """A round proposing `size` draft tokens took `seconds`."""
        self._window(self._round, (bucket(batch), size)).add(seconds, tag)

    def observe_switch(self, batch: int, size: int, seconds: float,
                       tag: int | None = None, untapped: bool = False) -> None:
        """The first step of a kind (`size` draft tokens, 0: plain) after one of another took
        `seconds`: what it took beyond a steady step of its kind is a switch's cost (not known
        before a steady step of its kind was measured); a plain one against plain steps that
        sent rows as it did (`untapped`: none), not against plain decoding's own."""
        steady = self.round_time(batch, size) if size else self._plain_step(batch, untapped)
        if steady is not None:
            self._window(self._switch, bucket(batch)).add(max(0.0, seconds - steady), tag)

    def observe_draft(self, batch: int, seconds: float) -> None:
        """A round waited `seconds` for its proposal (the draft's forward, on the round's path):
        a part of every round's time whatever its size."""
        self._window(self._draft, bucket(batch)).add(seconds)

    def observe_kept(self, sampled: bool, committed: Mapping[int, int]) -> None:
        """A round committed `committed[s]` tokens, or would have with `s` draft tokens (every
        candidate size up to the one it ran)."""
        for size, n in committed.items():
            if size in self.sizes:
                self._kept.setdefault((sampled, size), Ema(self.knobs.alpha)).add(float(n))

    # ---- estimates ------------------------------------------------------------------------------
    def plain_time(self, batch: int) -> float | None:
        """Seconds a plain step takes with speculation off: its untapped steps' (the steps
        next to rounds, which send the draft their rows, cost more: 4.0 against 2.4 ms for 8
        streams on 2 shards of an H200), else those measured; no more than the tapped steps'
        (while speculation wins only a refresh's tapped steps measure plain decoding again:
        untapped ones dearer than those are out of date, a first look's among prefills)."""
        b = bucket(batch)
        known = [w.value for w in (self._untapped.get(b), self._plain.get(b))
                 if w is not None and w.value is not None]
        return min(known) if known else None

    def _plain_step(self, batch: int, untapped: bool) -> float | None:
        """The median plain step that sent the draft rows (`untapped`: none), else any."""
        w = (self._untapped if untapped else self._plain).get(bucket(batch))
        return w.value if w is not None and w.value is not None else self.plain_time(batch)

    def tap_time(self, batch: int) -> float:
        """Seconds a plain step that sends the draft its rows takes beyond one that does not
        (0 until both are measured)."""
        b = bucket(batch)
        tapped, free = self._plain.get(b), self._untapped.get(b)
        if tapped is None or free is None or tapped.value is None or free.value is None:
            return 0.0
        return max(0.0, tapped.value - free.value)

    def switch_time(self, batch: int) -> float:
        """Seconds one switch between plain steps and rounds adds (0 until measured)."""
        w = self._switch.get(bucket(batch))
        return 0.0 if w is None or w.value is None else w.value

    def round_time(self, batch: int, size: int, fastest: bool = False) -> float | None:
        """Measured (`fastest`: the fastest of the latest rounds, else their median), else
        interpolated between a plain step and the draft's wait (size 0: what a round of no
        draft token would cost) and the measured sizes around `size` (beyond the largest
        measured one: that one's)."""
        b = bucket(batch)
        w = self._round.get((b, size))
        if w is not None:
            return w.low if fastest else w.value
        known = sorted((s, w.low if fastest else w.value)
                       for (bb, s), w in self._round.items() if bb == b)
        plain = self.plain_time(batch)
        draft = self._draft.get(b)
        if plain is not None and draft is not None and draft.value is not None:
            plain += draft.value
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

    def _batch_tokens(self, batch: int, sampled: bool, size: int) -> float | None:
        """Tokens a round at `size` commits for the whole batch's bucket (`b - k + k a(s)`)."""
        a = self.kept(sampled, size)
        if a is None:
            return None
        b = bucket(batch)
        k = min(self.spec_seqs, b)
        return b - k + k * a

    def rates(self, batch: int, sampled: bool, fastest: bool = False) -> dict[int, float]:
        """Estimated tokens a second of a batch of `batch` sequences (its bucket's size), `k`
        of them speculating (`spec_seqs`, at most all): {0: plain, b / t_plain; size: speculating
        at that size over a phase of `spec_steps` rounds, (b - k + k a(size)) / (t_round(size) +
        2 t_switch / spec_steps)}, for those that can be estimated (`fastest`: rounds priced by
        the fastest measured, `round_time`)."""
        out = {}
        plain = self.plain_time(batch)
        if plain is not None and plain > 0:
            out[0] = bucket(batch) / plain
        switch = 2.0 * self.switch_time(batch) / self.knobs.spec_steps
        for s in self.sizes:
            n, t = self._batch_tokens(batch, sampled, s), self.round_time(batch, s, fastest)
            if n is not None and t is not None and t + switch > 0:
                out[s] = n / (t + switch)
        return out

    def decide(self, batch: int, sampled: bool, current: int) -> int:
        """The best size (0: plain) by the estimates, speculation's discounted by `gain`;
        `current` stays unless beaten by `margin` (or cannot be estimated)."""
        k = self.knobs
        rates = {s: r / (1.0 + k.gain) if s else r
                 for s, r in self.rates(batch, sampled).items()}
        if not rates:
            return current
        best = max(rates, key=lambda s: (rates[s], -s))
        mine = rates.get(current)
        if mine is not None and rates[best] <= mine * (1.0 + k.margin):
            return current
        return best

    def _hopeless(self, batch: int, sampled: bool, size: int) -> bool:
        """Whether speculating at `size` is `abandon` times slower than plain decoding, even
        priced by its fastest rounds measured (two at least: one may have paused): a probe or
        a trial at that size then ends at once (the next decision weighs the other sizes)."""
        w = self._round.get((bucket(batch), size))
        if w is None or w.count < 2:
            return False
        rates = self.rates(batch, sampled, fastest=True)
        plain, mine = rates.get(0), rates.get(size)
        return plain is not None and mine is not None and mine * self.knobs.abandon < plain

    def probe_loss(self, batch: int, sampled: bool) -> float | None:
        """Seconds a probe (`probe` rounds at the largest size, its two switches and the `lead`
        plain steps before it that send the draft their rows) takes beyond plain steps
        committing as many tokens (None: not known yet)."""
        plain, t = self.plain_time(batch), self.round_time(batch, self.largest)
        n = self._batch_tokens(batch, sampled, self.largest)
        if plain is None or t is None or n is None:
            return None
        per_round = t - n / bucket(batch) * plain
        return max(0.0, self.knobs.probe * per_round + 2.0 * self.switch_time(batch)) + \
            self.knobs.lead * self.tap_time(batch)

    # ---- the plan -------------------------------------------------------------------------------
    def plan(self, batch: int, sampled: bool, clock: int) -> int:
        """Draft tokens the step of a sequence about to go out at `clock` (steps sent so far)
        proposes: 0 for a plain step."""
        key = (bucket(batch), sampled)
        ph = self._phase.get(key)
        if ph is None:  # a first look: plain steps measured, then a probe
            ph = self._phase[key] = Phase("look", 0, clock + self.knobs.refresh)
            self._choice[key] = self.largest  # (as configured, until the first decision)
        while clock >= ph.end or ((ph.kind == "probe" or ph.trial) and clock >= ph.start + 2
                                  and self._hopeless(batch, sampled, ph.size)):
            ph = self._phase[key] = self._next(key, ph, batch, sampled, clock)
        if ph.size:
            self.stats.rounds += 1
        else:
            self.stats.off_steps += 1
        return ph.size

    def _next(self, key: tuple[int, bool], ph: Phase, batch: int, sampled: bool,
              clock: int) -> Phase:
        k = self.knobs
        if ph.kind == "spec" and not ph.left:
            return Phase("refresh", 0, clock + k.refresh)
        if ph.kind == "look":  # (then plain steps that send rows: the probe's draft reads them)
            return Phase("first", 0, clock + max(k.lead, k.refresh))
        if ph.kind in ("off", "first"):
            futile = ph.futile if ph.futile is not None else self._futile(key, batch, sampled)
            if futile:  # (a probe that would lose: plain steps on; as `plain_left` judged it,
                # where it did: the runtime sent the draft no rows before a skipped probe)
                self.stats.skipped += 1
                return self._off(key, batch, sampled, clock, self._choice.get(key, 0),
                                 f"{ph.kind} (a probe skipped, priced from smaller batches)")
            self.stats.probes += ph.kind == "off"
            return Phase("probe", self.largest, clock + k.probe, start=clock)
        was = self._choice.get(key, 0)
        if ph.kind == "spec":  # a check: on the rounds just measured, the plain step as last
            now = self.decide(batch, sampled, ph.size)
            if now == ph.size:
                n = min(k.check, ph.left)
                return Phase("spec", now, clock + n, ph.left - n)
        else:  # after a refresh or a probe
            if ph.kind == "probe" and (w := self._round.get((key[0], self.largest))):
                w.keep_since(ph.start)  # (rounds from before the off phase may be stale: a
                # window of them would outvote the probe's few rounds for good)
            now = self.decide(batch, sampled, was if ph.kind == "refresh" else 0)
            self._decisions[key] = self._decisions.get(key, 0) + 1
        if now == 0:
            return self._off(key, batch, sampled, clock, was, ph.kind)
        self._chose(key, batch, sampled, clock, was, now, ph.kind)
        self._off_len.pop(key, None)
        if (key[0], now) not in self._round:  # priced, not measured: a short look first
            return Phase("spec", now, clock + k.probe, start=clock, trial=True)
        if now != self.largest and ph.kind != "spec" and self._decisions[key] % 4 == 0:
            # (larger sizes' acceptance)
            return Phase("spec", self.largest, clock + k.probe, start=clock, trial=True)
        n = min(k.check, k.spec_steps)
        return Phase("spec", now, clock + n, k.spec_steps - n)

    def _chose(self, key: tuple[int, bool], batch: int, sampled: bool, clock: int, was: int,
               now: int, after: str) -> None:
        self._choice[key] = now
        self.stats.size[key[0]] = now
        if log.isEnabledFor(logging.DEBUG):
            log.debug("clock %d bucket %d%s after %s: %s -> %s; %s", clock, key[0],
                      " sampled" if sampled else "", after, was, now,
                      self.describe(batch, sampled))
        if now != was:
            self.stats.switches += 1

    def _off(self, key: tuple[int, bool], batch: int, sampled: bool, clock: int, was: int,
             after: str) -> Phase:
        """Plain steps from `clock` on (speculation decided off, or a probe found futile)."""
        self._chose(key, batch, sampled, clock, was, 0, after)
        return Phase("off", 0, clock + self._off_steps(key, batch, sampled, was))

    def _futile(self, key: tuple[int, bool], batch: int, sampled: bool) -> bool:
        """Whether a probe of this batch's bucket would find speculation losing before it runs:
        priced as rounds of a smaller bucket measured (`prior_rates`), no size beats plain steps
        by `gain`. Only while off phases are shorter than `off_steps_max`: at that length a
        probe runs all the same (a prior may be wrong; it is checked at most that seldom)."""
        if self._off_len.get(key, 0) >= self.knobs.off_steps_max:
            return False
        rates = self.prior_rates(batch, sampled)
        plain = rates.pop(0, None)
        return plain is not None and bool(rates) and \
            max(rates.values()) <= plain * (1.0 + self.knobs.gain)

    def prior_rates(self, batch: int, sampled: bool) -> dict[int, float]:
        """`rates` of a bucket whose rounds were never measured, priced from smaller buckets:
        a round of size `s` takes this bucket's plain step plus the least that rounds of `s`
        took beyond a plain step in any smaller bucket whose rounds were measured (their
        fastest, `round_time`; a verify step of more sequences does at least that extra work:
        the same draft rows, the same proposal). Empty where a rate cannot be priced so: this
        bucket's rounds measured, its plain step not, or a size's acceptance not known."""
        b = bucket(batch)
        plain = self.plain_time(batch)
        if plain is None or plain <= 0 or any(bb == b for bb, _ in self._round):
            return {}
        smaller = sorted({bb for bb, _ in self._round if bb < b})
        out = {0: b / plain}
        for s in self.sizes:
            n = self._batch_tokens(batch, sampled, s)
            extra = [max(0.0, t - p) for bb in smaller
                     if (t := self.round_time(bb, s, fastest=True)) is not None and
                     (p := self.plain_time(bb)) is not None]
            if n is None or not extra:
                return {}
            out[s] = n / (plain + min(extra))
        return out

    def _off_steps(self, key: tuple[int, bool], batch: int, sampled: bool, was: int) -> int:
        """Plain steps before the next probe: `off_steps` after speculating, doubling while
        probes lose, and enough that a probe costs at most `probe_budget` of them."""
        k = self.knobs
        off = self._off_len.get(key)
        off = k.off_steps if off is None or was else min(2 * off, k.off_steps_max)
        loss, plain = self.probe_loss(batch, sampled), self.plain_time(batch)
        if loss is not None and plain:
            off = max(off, min(k.off_steps_max, math.ceil(loss / (k.probe_budget * plain))))
        self._off_len[key] = off
        return off

    def plain_left(self, batch: int, sampled: bool, clock: int) -> int:
        """Plain steps the current phase of this batch's bucket plans from `clock` on, the
        step at `clock` counted (0: the phase speculates, or none is planned yet); past its
        end where the probe there will be skipped (`_futile`, judged once within
        `PLAIN_LOOK` steps of it): the steps before a probe send the draft their rows, those
        before a skipped one need not."""
        key, k = (bucket(batch), sampled), self.knobs
        ph = self._phase.get(key)
        if ph is None or ph.size:
            return 0
        left = max(0, ph.end - clock)
        if ph.kind == "look":  # (its steps send the draft nothing: plain decoding's own)
            return left + max(k.lead, k.refresh) + PLAIN_LOOK
        if left <= PLAIN_LOOK and ph.kind in ("off", "first"):
            if ph.futile is None:
                ph.futile = self._futile(key, batch, sampled)
            if ph.futile:
                return left + self.knobs.off_steps  # (the next off phase's least length)
        return left

    def describe(self, batch: int, sampled: bool) -> str:
        """What a decision for this bucket weighs, in words (for the DEBUG log): each rate (the
        sizes' before `gain` discounts them), the plain step's, each size's round, the switch's
        and the draft's wait (ms), and each size's tokens a round."""
        b = bucket(batch)
        ms = lambda t: "-" if t is None else f"{1e3 * t:.2f}"  # noqa: E731
        draft = self._draft.get(b)
        rounds = " ".join(f"{s}:{ms(w.value)}x{w.count}" for (bb, s), w
                          in sorted(self._round.items()) if bb == b)
        kept = " ".join(f"{s}:{self.kept(sampled, s):.2f}" for s in self.sizes
                        if self.kept(sampled, s) is not None)
        rates = " ".join(f"{s}:{r:.0f}" for s, r in sorted(self.rates(batch, sampled).items()))
        return (f"tok/s {rates} (speculation's / {1 + self.knobs.gain:.2f}); plain "
                f"{ms(self.plain_time(batch))} ms, rounds {rounds or '-'}, switch "
                f"{ms(self.switch_time(batch))}, draft "
                f"{ms(None if draft is None else draft.value)}; kept {kept or '-'}")

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
    step to the next, given to the policy as that step's cost when it was a steady one (it came
    right after a step of the same kind: plain, or a round of any size), or as a switch's when
    it came after one of the other kind (the first step of a kind pays for the switch: the
    draft's context caught up, a proposal prepared for nothing); measured only when the next
    step is at the position it led to (one step, not two, lies between). Each measurement is
    tagged with the runtime's step it measured: the sequences of a batch count once."""

    def __init__(self, policy: SpecPolicy, sampled: bool) -> None:
        self.policy, self.sampled = policy, sampled
        self._told: int | None = None  # the size already planned for the next step
        self._last: list | None = None  # [size, start, batch, position the next step is at,
        # clock it was planned at]
        self._before: int | None = None  # the size of the step before the last
        self._untapped: deque[int] = deque(maxlen=8)  # the latest positions whose steps sent
        # the draft no rows (`untapped`)

    def untapped(self, pos: int) -> None:
        """The step at `pos` sent the draft no feature rows (a plain step far from a round:
        plain decoding's own, measured apart, `SpecPolicy.plain_time`)."""
        self._untapped.append(pos)

    def step(self, pos: int, batch: int, clock: int, now: float) -> int:
        """The size of the step at `pos` (0: plain), planned at `clock` with `batch` sequences
        decoding, `now` on a monotonic clock."""
        if self._last is not None:
            size, start, b, expect, tag = self._last
            if expect == pos and size >= 0 and self._before is not None and self._before >= 0:
                if (self._before == 0) != (size == 0):  # (a round after a round of another
                    # size is a round: the draft was told that size, nothing to catch up on)
                    self.policy.observe_switch(b, size, now - start, tag,
                                               untapped=not size and expect - 1 in self._untapped)
                elif size:
                    self.policy.observe_round(b, size, now - start, tag)
                else:
                    self.policy.observe_plain(b, now - start, tag,
                                              untapped=expect - 1 in self._untapped)
            self._before = size
        size = self._told if self._told is not None else self.policy.plan(
            batch, self.sampled, clock)
        self._told = None
        self._last = [size, now, batch, pos + 1 if size == 0 else None, clock]
        return size

    @property
    def told(self) -> int | None:
        """The size planned ahead for the next step (None: not planned yet)."""
        return self._told

    def plan_next(self, batch: int, clock: int) -> int:
        """The size of the step after this one, decided now (the draft prepares it)."""
        self._told = self.policy.plan(batch, self.sampled, clock)
        return self._told

    def ran(self, size: int, next_pos: int, committed: Mapping[int, int],
            draft: float | None = None) -> None:
        """The round planned at the last `step` verified `size` draft tokens and the next step
        is at `next_pos`; `committed`: `committed_by_size`; `draft`: seconds it waited for its
        proposal, where known."""
        if self._last is not None and self._last[0] == size:
            self._last[3] = next_pos
            if draft is not None:
                self.policy.observe_draft(self._last[2], draft)
        self.policy.observe_kept(self.sampled, committed)

    def missed(self) -> None:
        """The step planned as a round ran plain (no proposal came): not measured."""
        if self._last is not None:
            self._last[0] = -1
