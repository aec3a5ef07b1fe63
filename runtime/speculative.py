"""The coordinator's side of speculative decoding: asking the draft process for proposals, and
what speculation achieved (acceptance per position, draft and verify time).

The loop itself is `runtime.generate.token_stream` with a `Drafter`; verification happens on the
last shard (`shards.accept.accept_draft`). A draft that fails stops speculation, never the
generation: the request goes on with plain decode steps (logged), unless the configuration
demands speculation (`spec_required`), in which case the request fails with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from layersplit.ipc.messages import message
from layersplit.runtime.errors import DraftError, DraftLost, ShardFailure
from layersplit.runtime.spec_policy import Pacer, SpecPolicy, committed_by_size, tree_ranks
from layersplit.shards.spec_tree import check_proposal, check_q, rows_to_move

if TYPE_CHECKING:
    from layersplit.runtime.config import RuntimeConfig
    from layersplit.shards.model_config import ModelConfig

log = logging.getLogger(__name__)
TAP_LEAD = 24  # plain steps before a planned round from which a sequence's plain steps send the
# draft their feature rows again (`DraftClient.taps`): its first proposal reads them
RESTART_ROWS = 16  # a round needs the rows of at least this many steps since the draft's
# context last missed some (`draft_gap`); before, the step runs plain


def draft_taps(path: str | Path | None) -> list[int]:
    """The target layers a feature-conditioned draft reads ([] for a classic draft)."""
    from layersplit.draft.dflash_config import dflash_folder, read_dflash_config

    folder = None if path is None else dflash_folder(path)
    return [] if folder is None else list(read_dflash_config(folder).target_layer_ids)


def spec_sampling_mode(setting: str, devices: Sequence[str], kind: str | None,
                       measured: bool = False) -> str:
    """`spec_sampling` as it applies to a sampled request: `auto` is `coupled` where the
    speculation policy measures (`measured`: it turns speculation off where it does not pay,
    for sampled requests apart from greedy ones); else `off` for a DFlash draft where the
    target or the draft runs on a GPU (`devices`: theirs; sampled DFlash speculation there
    measured 0.61 x plain decoding and greedy 1.16 x, H200, 2026-11-28, `bench/RESULTS.md`),
    else `coupled` (a classic draft's sampled proposals were not measured; on CPUs speculation
    is for exactness, not speed). `off`: sampled requests do not speculate (they still feed the
    draft where a context is free, so the prefixes they cache carry its feature rows)."""
    if setting != "auto":
        return setting
    gpu = any(d.startswith("cuda") for d in devices)
    return "off" if gpu and kind == "dflash" and not measured else "coupled"


def tree_size(info: dict[str, Any], config: RuntimeConfig, chunk: int) -> int:
    """Draft tokens of a verify step's token tree (0: chains): the draft's tree (`info`, its
    configure reply), at most `spec_tree`, and the rows of a step (`chunk`) allow."""
    tree = int(info.get("tree_nodes", 0))
    if config.spec_tree is not None:
        tree = min(tree, config.spec_tree)
    return min(tree, chunk - 1)


def verify_shape(info: dict[str, Any], config: RuntimeConfig, chunk: int) -> tuple[int, int]:
    """(block, tree) of a verify step with the draft `info` (its configure reply): a chain of
    `block` rows (the last token and block - 1 draft tokens), no more than the shards' rows of
    a step (`chunk`, prefill_chunk) allow; `tree` draft tokens of a token tree (0: chains)."""
    block = min(int(config.spec_block or info["block_size"]), int(info["block_size"]), chunk)
    return block, tree_size(info, config, chunk) if block > 1 else 0


def warm_verify_rows(block: int, tree: int, policy_sizes: Sequence[int], hybrid: bool) -> list[int]:
    """The row counts of the verify steps a request may replay as graphs, for the warm-up at
    start: a chain of `block` rows, a tree of `tree` draft tokens (1 + tree rows) and each draft
    token count the speculation policy may choose (`policy_sizes`: 1 + size rows; a tree's node
    counts where the draft has a tree, else a chain's depths). A hybrid target's tree steps run
    row by row (its states kept after each row), never as a graph, so there only its chains:
    the `block`-row chains alone where the draft has a tree (at a context's end), else every
    chain length. A graph of a tree's rows would be captured for nothing, and the keep buffers
    sized to its rows (~147 MB a row at the Qwen3.5-27B shape)."""
    if hybrid:
        rows = {block} if tree else {block, *(1 + s for s in policy_sizes)}
    else:
        rows = {block, *(1 + s for s in policy_sizes), *((1 + tree,) if tree else ())}
    return sorted(n for n in rows if n > 1)


@dataclasses.dataclass
class SpecStats:
    """What speculation did for one request (or, summed, for a run)."""

    verifies: int = 0
    committed: int = 0  # tokens the verify steps committed: kept draft tokens + one each
    proposed_at: list[int] = dataclasses.field(default_factory=list)  # by draft position
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    off_chain: int = 0  # verify steps of a token tree that kept a path besides its first
    prepared: int = 0  # proposals the draft had ready, prepared from the verdict
    tokens_sent: int = 0  # committed tokens sent to a classic draft (each once, ideally)
    # of those (seconds, summed; one host clock): the verdict reached the draft after the result
    # reached the coordinator's sequence; the request reached the draft after it was sent; the
    # proposal was ready before the request was sent
    verdict_lag_s: float = 0.0
    request_lag_s: float = 0.0
    ready_lead_s: float = 0.0
    off_steps: int = 0  # plain decode steps the policy chose (`runtime.spec_policy`)
    untapped: int = 0  # of those, steps that sent the draft no feature rows (`DraftClient.taps`)
    restarts: int = 0  # runs of such steps the draft was told of (`draft_gap`)
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)  # draft tokens verified
    # (a tree's nodes, a chain's depth) -> verify steps that proposed that many
    draft_s: float = 0.0  # proposals, as the coordinator waits for them
    draft_compute_s: float = 0.0  # of which the draft process computed
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per verify step (1 = no draft token kept)."""
        return self.committed / self.verifies if self.verifies else None

    def acceptance_rates(self) -> list[float]:
        """Fraction of proposals whose j-th draft token was kept, j = 1, 2, ..."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def _grow(self, n: int) -> None:
        if n > len(self.proposed_at):
            self.proposed_at += [0] * (n - len(self.proposed_at))
            self.accepted_at += [0] * (n - len(self.accepted_at))

    def add(self, proposed: int, accepted: int) -> None:
        """One verify step kept `accepted` of `proposed` draft tokens."""
        self.verifies += 1
        self.committed += accepted + 1
        self._grow(proposed)
        for j in range(proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    def merge(self, other: SpecStats) -> None:
        self.verifies += other.verifies
        self.committed += other.committed
        self.off_steps += other.off_steps
        self.untapped += other.untapped
        self.restarts += other.restarts
        for size, n in other.sizes.items():
            self.sizes[size] = self.sizes.get(size, 0) + n
        self.off_chain += other.off_chain
        self.prepared += other.prepared
        self.tokens_sent += other.tokens_sent
        self.verdict_lag_s += other.verdict_lag_s
        self.request_lag_s += other.request_lag_s
        self.ready_lead_s += other.ready_lead_s
        self.draft_s += other.draft_s
        self.draft_compute_s += other.draft_compute_s
        self.verify_s += other.verify_s
        self._grow(len(other.proposed_at))
        for j, (p, a) in enumerate(zip(other.proposed_at, other.accepted_at)):
            self.proposed_at[j] += p
            self.accepted_at[j] += a


class DraftHost(Protocol):
    """What a sequence's drafter needs of the runtime (`runtime.coordinator.Coordinator` is
    one): the draft process's reply to a request, whether it is there and feeds on the
    shards' rows, and a way to fail the runtime when the shards break the protocol."""

    config: RuntimeConfig
    model_config: ModelConfig
    chunk: int
    draft: Any  # the draft process's handle, while it serves
    draft_down: str | None  # why it is gone
    draft_info: dict[str, Any]
    push_drafts: bool
    spec_policy: SpecPolicy | None
    # (`spec_clock`: steps sent so far and sequences decoding, the policy's clock and batch;
    # `spec_policy`: the policy under `spec_policy` auto or measured, None when always on)

    @property
    def feeding(self) -> bool: ...
    def draft_request(self, msg: dict[str, Any], frames: Sequence[Any] = ()) -> dict[str, Any]: ...
    def feat_sid(self, context: int) -> int: ...
    def parked(self, context: int) -> bool: ...
    def new_context(self, context: int) -> None: ...
    def fail(self, why: str, keep_running: bool = False) -> ShardFailure: ...
    def spec_clock(self) -> tuple[int, int]: ...


class DraftClient:
    """The `Drafter` of one sequence: proposals from the draft process."""

    def __init__(self, coord: DraftHost, stats: SpecStats, required: bool,
                 context: int, sample: dict | None = None) -> None:
        """`context`: the sequence's context in the draft process (its rows and draft KV);
        `sample`: the sequence's sampling ({temperature, top_k, top_p, seed}) when it samples
        and `spec_sampling` is not `guesses`, with its `mode`: a DFlash draft then samples its
        proposals (`shards.spec_sampling`)."""
        self.coord, self.stats, self.required, self.context = coord, stats, required, context
        info = coord.draft_info
        self.kind = info["kind"]
        self.sample = sample if self.kind == "dflash" else None
        # a verify step is a step: no more rows than the shards take (prefill_chunk); a token
        # tree of up to `tree` draft tokens where the draft has a tree shape
        self.block, self.tree = verify_shape(info, coord.config, coord.chunk)
        self.rows = 1 + self.tree if self.tree else self.block
        # under the policy each step's size (tree nodes, or chain depth) is chosen, else the
        # whole tree or chain; the size of the step at a position: (pos, size)
        self.full = self.tree or self.block - 1
        policy = coord.spec_policy
        self.pacer = None if policy is None or self.full < 1 else Pacer(policy, sample is not None)
        self._size_at: tuple[int, int] | None = None
        self.shape = info.get("tree_shape")
        # (position of the next proposal, tree rows the last verify kept): the draft moves them
        self.kept: tuple[int, list[int]] | None = None
        self.vocab = coord.model_config.vocab_size
        self.start = 0  # classic: the draft's own KV holds the committed rows [0, start)
        self.active = True
        # the draft hands the first shard the proposal it prepares from a verdict: the
        # position of the one it prepares now (after a step that told it `then`), else None
        self.push = coord.push_drafts and self.kind == "dflash"
        self._told = False  # the step in flight told the draft `then`
        self._then: tuple[int, int] | None = None  # (depth, tree) of the proposal it prepares
        self._pushed_at: int | None = None
        self._t_proposed = 0.0
        self._t_verified = 0.0
        self._draft_wait: float | None = None  # seconds the round in flight waited for its
        # proposal (the policy prices a round's draft part with it)
        self._gap: int | None = None  # the position of the first step that went out without
        # its feature rows since the last that sent them (`taps`)
        self.resumed = -RESTART_ROWS  # the position from which the draft has every row again
        # (`draft_gap`; a sequence's own rows from its first)
        self._clock: int | None = None  # the runtime's clock at this sequence's last step
        self._pace = 1.0  # runtime steps (the policy's clock) per step of this sequence, an
        # average: other micro-batches' steps and prefill chunks move the clock too
        self._failed: Exception | None = None  # a draft failure met sending a step (`taps`),
        # raised by the next proposal, in this request's own flow
        self._lead_end: int | None = None  # the phase end (runtime clock) rows last went
        # toward: until it, steps tap (`taps`)

    def _size(self, pos: int) -> int:
        """Draft tokens of the step at `pos` (0: a plain step), planned once per step."""
        if self._size_at is not None and self._size_at[0] == pos:
            return self._size_at[1]
        size = self.full
        if self.pacer is not None:
            clock, batch = self.coord.spec_clock()
            size = self.pacer.step(pos, batch, clock, time.perf_counter())
            if size and (self.coord.parked(self.context) or self._gap is not None
                         or pos - self.resumed < RESTART_ROWS):
                # (a batch of another size came: its phase speculates now) the proposal needs
                # the rows the shards parked, which a step not parked sends, or rows a step
                # still has to send (untapped ones: the draft is told of them as the next one
                # that taps goes out), or more recent rows than the steps since then sent:
                # this one, plain (not measured)
                self.pacer.missed()
                size = 0
            if size == 0:
                self.stats.off_steps += 1
        self._size_at = (pos, size)
        return size

    def _shape(self, size: int, n: int, rows: int) -> tuple[int, int]:
        """(depth, tree nodes) of a proposal of `size` draft tokens with `n` positions and
        `rows` draft rows of room: a whole tree or a chain (a tree cut to fit the context's end
        would be a new shape of verify step: a graph, a compilation, for a handful of steps)."""
        if self.tree:
            return n, size if rows >= size else 0
        return min(n, size), 0

    def begin(self) -> None:
        """A new sequence: the draft forgets the last one."""
        try:
            self.coord.new_context(self.context)
            self.coord.draft_request(message("draft_begin", slot=self.context,
                                             sample=self.sample))
        except (DraftLost, DraftError) as e:
            self._stop(e)

    def _stop(self, e: Exception) -> None:
        self.active = False
        if self.required:
            why = f"speculation is required (spec_required) but the draft failed: {e}"
            if isinstance(e, DraftLost):  # the whole group restarts (the server), draft included
                raise self.coord.fail(why)
            raise ShardFailure(why, runtime_down=False)
        log.warning("this request goes on without speculation: %s", e)

    def propose(self, seq: Sequence[int], pos: int, n: int,
                rows: int) -> tuple[list[int], list[int] | None, list | None]:
        if self._failed is not None:
            e, self._failed = self._failed, None
            self._stop(e)
        if not self.active:
            return [], None, None
        size = self._size(pos)
        if size == 0:
            return [], None, None
        n, tree = self._shape(size, n, rows)
        t0 = time.perf_counter()
        frames = []
        start = 0
        if self.kind == "classic":
            start = self.start
            frames = [np.asarray(seq[start:pos], dtype=np.int64)]
            self.stats.tokens_sent += pos - start
        try:
            kept = self.kept[1] if self.kept is not None and self.kept[0] == pos else None
            self.kept = None
            t_sent = time.monotonic()
            reply = self.coord.draft_request(message(
                "propose", slot=self.context, pos=pos, n=n, token=int(seq[pos]), start=start,
                sync=self.coord.feat_sid(self.context), tree=tree, kept=kept), frames)
            tokens = reply.get("tokens") if reply.get("type") == "proposal" else None
            parents, q = reply.get("parents"), reply.get("q")
            try:
                check_proposal(tokens, parents, n, tree, self.vocab)
                if q is not None:
                    check_q(q, tokens, parents, self.vocab)
            except ValueError as e:
                raise DraftError(f"the draft proposed {e}") from e
        except (DraftLost, DraftError) as e:
            self._stop(e)
            if self.pacer is not None:
                self.pacer.missed()
            return [], None, None
        now = time.perf_counter()
        self.stats.draft_s += now - t0
        self._draft_wait = now - t0
        compute = reply.get("compute_s")
        if isinstance(compute, float):
            self.stats.draft_compute_s += compute
        if reply.get("prepared") is True and all(isinstance(reply.get(k), float) for k in (
                "verdict_at", "ready_at", "asked_at")):
            self.stats.prepared += 1
            self.stats.verdict_lag_s += reply["verdict_at"] - self._t_verified
            self.stats.request_lag_s += reply["asked_at"] - t_sent
            self.stats.ready_lead_s += t_sent - reply["ready_at"]
        self._t_proposed = now
        return tokens, parents, q

    def ask(self, pos: int, n: int, rows: int) -> dict | None:
        if not self.active:
            return None
        size = self._size(pos)
        if size == 0 or not self.push or self._pushed_at != pos or not self.coord.feeding:
            return None
        n, tree = self._shape(size, n, rows)
        if (n, tree) != self._then:  # not the proposal the draft prepares
            return None
        self._t_proposed = time.perf_counter()
        self.kept = None  # the draft moved the kept rows when it prepared the proposal
        return {"n": n, "tree": tree}

    def delivered(self, asked: dict | None) -> tuple[list[int], list[int] | None]:
        """(Checked: the first shard verified these very tokens, so a malformed report is the
        shards' fault, and fails the runtime.)"""
        if asked is None and self.coord.draft is None:  # lost before the step went out: the
            self._stop(DraftLost(self.coord.draft_down or "the draft is gone"))  # step asked
            return [], None  # for nothing and ran plain
        ok = isinstance(asked, dict) and isinstance(asked.get("waited"), float) and (
            isinstance(asked.get("missed"), str) or isinstance(asked.get("draft"), list))
        if not ok:
            raise self.coord.fail(f"the last shard reported {str(asked)[:200]} for a step "
                                   "that asked for draft tokens")
        self.stats.draft_s += asked["waited"]
        self._draft_wait = asked["waited"]
        self._t_proposed += asked["waited"]  # (the wait is the draft's, not the verify's)
        if asked["missed"] is not None:
            if self.pacer is not None:
                self.pacer.missed()
            why = f"the first shard got no proposal: {asked['missed']}"
            self._stop(DraftLost(why) if self.coord.draft is None else DraftError(why))
            return [], None
        tokens, parents = asked["draft"], asked["tree"]
        if not tokens or not all(isinstance(t, int) and 0 <= t < self.vocab for t in tokens):
            raise self.coord.fail(f"the last shard reported draft tokens {str(tokens)[:80]}")
        self.stats.prepared += 1
        compute = asked.get("compute")
        if isinstance(compute, float):
            self.stats.draft_compute_s += compute
        return tokens, parents

    def verified(self, pos: int, proposed: int, accepted: int, path: list[int] | None) -> None:
        self._pushed_at = pos + accepted + 1 if self._told else None
        self._told = False
        self._t_verified = time.monotonic()
        self.stats.verify_s += time.perf_counter() - self._t_proposed
        self.stats.add(proposed, accepted)
        size = self._size_at[1] if self._size_at is not None and self._size_at[0] == pos else 0
        self.stats.sizes[size] = self.stats.sizes.get(size, 0) + 1
        if self.pacer is not None and size:
            ranks = list(range(accepted))  # a chain's kept rows: depths 1..accepted
            if self.tree and self.shape:  # (a tree of a chain's shape came with no path)
                prio = tree_ranks(self.shape, size, self.block - 1)
                ranks = [prio[j - 1] for j in (path or range(1, accepted + 1))]
            elif self.tree:  # (a tree proposal without a known shape: only its own size)
                ranks = [0] * accepted
            sizes = self.pacer.policy.sizes if self.shape or not self.tree else [size]
            self.pacer.ran(size, pos + accepted + 1, committed_by_size(sizes, size, ranks),
                           self._draft_wait)
        self._draft_wait = None
        moving = rows_to_move(path)
        if moving is not None:
            self.kept = (pos + accepted + 1, moving)
            self.stats.off_chain += 1
        if self.kind == "classic":  # its rows [pos, pos + kept] were computed from kept tokens
            self.start = pos + min(accepted, proposed - 1) + 1

    def plain_next(self) -> bool:
        """Whether the step after the one in flight is a plain decode step (decided now, under
        the policy: the batch may send it ahead, `runtime.batching`)."""
        if not self.active:
            return True
        if self.pacer is None:
            return False
        if self.pacer.told is None:  # (the step in flight is counted: the next goes at clock)
            clock, batch = self.coord.spec_clock()
            self.pacer.plan_next(batch, clock)
        return self.pacer.told == 0

    def taps(self, pos: int, may_skip: bool) -> bool:
        """Whether the step at `pos` going out now sends the draft its feature rows: not when
        it `may_skip` them (a plain decode step past the prompt) and the policy plans more than
        `TAP_LEAD` plain steps for this sequence's batch from now, or the sequence no longer
        speculates. A round's proposal reads the rows of the steps before it; those of a long
        plain stretch would be computed, parked and dropped, a cost a draft that does not
        propose would add to every plain step. The first step that sends rows again tells the
        draft which rows never came (`draft_gap`: its proposals read every other row). The
        lead is in this sequence's steps: the policy plans in runtime steps, of which other
        micro-batches' and prefill chunks take a share (`_pace`); once rows go again toward a
        phase's end they go until it (a pace that falls meanwhile makes no second gap). A
        draft that fails here fails this request at its next proposal, not the step's other
        sequences (only a link whose loss fails the runtime raises, `ShardFailure`)."""
        clock, batch = self.coord.spec_clock()
        if self._clock is not None:  # (the clock moved since this sequence's last step)
            self._pace += 0.25 * (min(max(clock - self._clock, 1), 8) - self._pace)
        self._clock = clock
        if not self.active:
            if may_skip:
                return False
        elif may_skip and self.pacer is not None and not self.pacer.told and \
                self.kind == "dflash":
            left = self.pacer.policy.plain_left(batch, self.pacer.sampled, clock)
            end = clock + left  # (the phase's end, on the runtime's clock)
            if left > TAP_LEAD * self._pace and (self._lead_end is None or end > self._lead_end):
                if self._gap is None:
                    self._gap = pos
                self.stats.untapped += 1
                self.pacer.untapped(pos)
                return False
            if left > 0:
                self._lead_end = end
        if self._gap is not None and self.active:
            start, self._gap = self._gap, None
            if start < pos:  # (not when the untapped step was one sent ahead and dropped)
                try:
                    self.coord.draft_request(message("draft_gap", slot=self.context,
                                                     start=start, end=pos))
                except (DraftLost, DraftError) as e:
                    if self.required:
                        log.warning("the draft failed telling it of untapped rows (%s); this "
                                    "request fails at its next proposal", e)
                        self._failed = e
                    else:
                        self._stop(e)
                    return False
                self.resumed = pos
                self.stats.restarts += 1
        return True

    def _plain_left(self) -> int:
        clock, batch = self.coord.spec_clock()
        return self.pacer.policy.plain_left(batch, self.pacer.sampled, clock)

    def may_park(self) -> bool:
        """Whether the plain decode step going out now may leave its feature rows parked on
        the shards (`shards.parked_rows`): where the policy has this sequence's next step
        decode plainly too (a round's proposal needs the rows of every step before it), or
        the sequence no longer speculates."""
        if not self.active:
            return True
        if self.pacer is None or (self.pacer.told or 0) > 0:
            return False
        # (this sequence's next step comes `_pace` runtime steps on: plain still, with margin)
        return self._plain_left() > 2 * self._pace

    def then(self) -> dict | None:
        if not self.active or self.kind != "dflash":
            return None
        size = self.full
        if self.pacer is not None:
            clock, batch = self.coord.spec_clock()
            size = self.pacer.plan_next(batch, clock + 1)
            if size == 0 and not self.tree:
                return None
            if size == 0:  # the next step is plain, but the draft moves the tree rows this
                # step keeps into place as it prepares a proposal (one left unused)
                size = self._size_at[1] if self._size_at is not None else self.full
        self._told = self.push
        self._then = self._shape(size, self.block - 1, self.full)
        return {"n": self._then[0], "tree": self._then[1], "push": self.push}
