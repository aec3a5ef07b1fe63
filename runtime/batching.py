"""Continuous batching: many sequence programs (`runtime.generate.sequence_program`) share the
shard chain, with a step of every micro-batch in flight.

Each request gets a KV slot from the scheduler (`runtime.scheduler`), then its program runs:
the steps it asks for are batched with the other sequences of its micro-batch into one step
message (one segment per sequence), and its tokens come out as the results return. Up to
`MAX_IN_FLIGHT` steps travel the chain at once: one per micro-batch, so while shard i works on
one micro-batch shard i+1 works on the previous one, plus prefill chunks whose output no program
waits for (the chunks of one long prompt then flow through the shards overlapped: shard i
prefills chunk k while shard i+1 prefills chunk k-1).

Every shard takes steps in the order they were sent, so a sequence's steps reach each shard in
order, and a slot is handed to the next request only when no step of its last owner is still
in flight.

KV blocks: before a step goes out, each of its sequences' block tables grows to cover the rows
the step writes (`Scheduler.grow`). When the pool is full, the youngest running sequence with
no step in flight is preempted, by swap where it can be: its blocks' rows are copied to the
host-memory KV pool of every shard (`Coordinator.kv_swap`; the coordinator's `host`
BlockManager hands out the host blocks, `host_pool` meters the shards' host memory, which
the prefix cache's RAM tier shares: its snapshots are evicted, least recently used first, to
make room, `runtime.host_pool`), its device blocks are free at once, and it waits at
the head of the queue, keeping its slot, its program (suspended at the step it asked for)
and everything it generated. Re-admitted (before any new request), it gets device blocks for
that step again, in the same slot, its rows are copied back in (every shard has replied
before the step goes out), and its program goes on where it stopped: no row is computed
twice, and its tokens and logits are those of an uninterrupted run. Blocks it shared with a
live prefix go to the host pool like its own and come back as blocks of its own.

Where it cannot be swapped (`kv_host_blocks` 0, host memory too full even once the RAM tier's
snapshots are evicted, a hybrid model whose recurrent state is not in blocks, a sequence that
feeds the draft process or speculates, or one whose shared-prefix block copy was not sent
yet), it is preempted by re-prefill: its program is closed, its slot and blocks are free at
once, and it waits at the head of the queue to run again from its prompt and the tokens it
generated (`Request.make` starts it again from those, from the prefix cache where it holds
them), so it yields the tokens an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from layersplit.runtime.batch_stats import BatchStats
from layersplit.runtime.block_manager import BlockManager
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Delta, OutputStream, Program, SampleRequest, StepRequest
from layersplit.runtime.host_pool import HostPool
from layersplit.runtime.scheduler import Ready, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    import numpy as np
    from layersplit.runtime.generate import StepOutput
    from layersplit.shards.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class StepChain(Protocol):
    """What the batch needs of the shard chain (`runtime.coordinator.Coordinator` is one):
    send a step, wait for steps to come back, read and forget their outputs, sample, and move
    KV blocks between the shards' device and host pools."""

    failed: str | None  # why the runtime went down, if it did

    def send_step(self, segs: Sequence[tuple[int, StepRequest, int | None]]) -> int: ...
    def wait_steps(self) -> list[int]: ...
    def step_outputs(self, sid: int) -> list[StepOutput]: ...
    def forget_steps(self, sids: Sequence[int] | None = None) -> None: ...
    def kv_swap(self, direction: str, pairs: Sequence[Sequence[int]]) -> None: ...
    def sample_logits(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int) -> int: ...
    def sample_output(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int, extra: dict | None = None) -> StepOutput: ...


MAX_IN_FLIGHT = 4  # steps in the chain at once; no ring of the chain (4 slots) then fills up


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence in the batch. `deltas` fill as it generates; `done` once it stopped (its
    stop rules, the context, a cancel, or a failure: `error`) and its slot is free."""

    rid: int
    prompt_tokens: int
    make: Callable[[int], Program]  # slot -> the sequence's program (from its prompt and the
    # tokens it generated so far: a preempted sequence starts again with it)
    out: OutputStream  # stop rules and text of its tokens
    deltas: deque[Delta] = dataclasses.field(default_factory=deque)  # text not yet taken
    done: bool = False
    error: BaseException | None = None
    cancelled: bool = False
    slot: int = -1
    program: Program | None = None
    pending: StepRequest | None = None  # the step it asks for, not sent yet
    in_flight: int = 0  # its steps in the chain
    waits: int | None = None  # the step whose output its program waits for
    feed: int | None = None  # its draft context, when its segments feed the draft process
    preempted: int = 0  # times its blocks were taken back
    swapped: int | None = None  # rows its blocks held when swapped out (its KV is in the
    # host pool, in `Batcher.host`'s table for its rid); None: not swapped out
    rows_gone: bool = False  # its slot's blocks no longer hold its program's rows (swapped
    # out and not swapped back in: freed, maybe another sequence's now): what its program
    # would still copy of them (a prompt's deferred snapshots, `RequestFlow._program`) is
    # dropped
    prompt: list[int] | None = None  # its tokens, when it may share a live prefix's blocks
    cuts: list[int] = dataclasses.field(default_factory=list)  # its prompt's chunk boundaries
    prefilled: int = 0  # prompt rows whose KV the steps sent so far write (or a restore did)
    shared: int = 0  # prompt rows it took from another live sequence's blocks
    base_tokens: int = 0  # its prompt's tokens (prompt_tokens adds those generated when it is
    # preempted)
    share_writes: frozenset[int] = frozenset()  # the steps in flight, when it took a live
    # prefix, of the sequence whose rows it took (they may not have written them yet)
    cached: Callable[[list[int]], int] | None = None  # prompt -> rows the prefix cache would
    # restore for it (a live prefix is taken only if longer); None: it shares no live prefix
    ahead: tuple[int, StepRequest] | None = None  # its lookahead step in flight (sid, step),
    # not yet the step its program asks for (`Batcher._send_ahead`)
    stale_state: bool = False  # a recurrent state took a lookahead row its program then did
    # not ask for: it runs again from its tokens once its steps are back (`Batcher._adopt`)
    after: Request | None = None  # queued only once this one is over (its prompt starts with
    # the turn that one keeps in the prefix cache, `RequestFlow.keep_turn`)
    speculates: bool = False  # it has a drafter (`RequestFlow._program`): it may speculate
    plain_next: Callable[[], bool] | None = None  # a speculating sequence's: whether its next
    # step is a plain decode step (`runtime.speculative.DraftClient.plain_next`)
    may_park: Callable[[], bool] | None = None  # a feeding sequence's: whether its plain decode
    # step going out now may park its feature rows (`DraftClient.may_park`; None: never)
    taps: Callable[[int, bool], bool] | None = None  # a feeding sequence's: whether its step at
    # a position going out now sends the draft its feature rows, given whether it may not (a
    # plain decode step past its prompt) (`DraftClient.taps`; None: every step sends them)


@dataclasses.dataclass(slots=True)
class _Step:
    sid: int
    reqs: list[Request]
    group: int | None  # the micro-batch whose step it is (None: extra prefill chunks)
    sent: list[StepRequest]  # each request's step, in `reqs`' order
    behind: bool = False  # a lookahead step follows it


class Batcher:
    def __init__(self, coord: StepChain, config: SchedulerConfig,
                 host_blocks: int = 0, host_pool: HostPool | None = None) -> None:
        self.coord = coord
        self.sched = Scheduler(config)
        # the shards' host KV block ids, tables keyed by rid (None: no swap preemption)
        self.host = BlockManager(host_blocks, config.block_tokens) if host_blocks > 0 else None
        # the shards' host memory, shared with the prefix cache's RAM tier (None: unmetered)
        self.host_pool = host_pool
        self.requests: dict[int, Request] = {}
        self.held: list[Request] = []  # submitted, queued once their `after` is over
        self.steps: dict[int, _Step] = {}
        self._ids = itertools.count(1)
        self.stats = BatchStats()
        self.step_observer: Callable[[int], None] | None = None  # sequences per step sent
        self.share_prefixes = True  # (off for models whose state is not all in the KV rows)
        self.look_ahead = False  # send decode steps ahead (`_send_ahead`: one-shard runtimes)
        self.recurrent = False  # the model's sequences hold a recurrent state besides KV rows
        # (a hybrid model's): a row it takes cannot be taken again, nor undone

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt_tokens: int, make: Callable[[int], Program],
               out: OutputStream, prompt: list[int] | None = None,
               cuts: list[int] | None = None,
               cached: Callable[[list[int]], int] | None = None,
               after: Request | None = None) -> Request:
        """Queue a request; with its `prompt`, the prompt's chunk boundaries `cuts` and
        `cached` (what the prefix cache holds of a prompt), it may start with the blocks of a
        live sequence that prefilled more of the same first tokens than the cache holds.
        `after`: it is queued only once that request is over (which snapshots rows it
        restores, with their draft feature rows, where a live prefix would lend it no feature
        rows)."""
        req = Request(next(self._ids), prompt_tokens, make, out, base_tokens=prompt_tokens,
                      prompt=prompt, cuts=cuts or [], cached=cached,
                      after=after if after is not None and not after.done else None)
        if out.finished:  # nothing to generate (max_tokens 0)
            self._end(req, admitted=False)
            return req
        self.requests[req.rid] = req
        if req.after is not None:
            self.held.append(req)
        else:
            self.sched.submit(req.rid, prompt_tokens)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request: its slot is free at once (or when its last step in flight is back)."""
        if req.done or req.cancelled:
            return
        req.cancelled = True
        if req in self.held:
            self.held.remove(req)
            self._end(req, admitted=False)
        elif self.sched.cancel_waiting(req.rid):
            self._end(req, admitted=False)
        elif req.in_flight == 0:
            self._end(req)

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    # ---- the loop -----------------------------------------------------------------------------
    def run_once(self) -> None:
        """Admit what fits, send the steps that are ready, and take in the results that come
        back (waiting for one when steps are in flight)."""
        if self.coord.failed is not None:  # the runtime went down under some request
            self._fail_all(ShardFailure(f"the runtime is down: {self.coord.failed}"))
            return
        for req in [r for r in self.held if r.after.done]:  # (in the order they came)
            self.held.remove(req)
            self.sched.submit(req.rid, req.prompt_tokens)
        self._admit()
        self._send_ready()
        if self.steps:
            try:
                sids = self.coord.wait_steps()
            except ShardFailure as e:
                if e.runtime_down:  # every request fails with the runtime
                    self._fail_all(e)
                else:  # an error no step in flight claims: the steps go on
                    log.warning("%s", e)
                return
            for sid in sids:
                self._dispatch(sid)

    def _admit(self) -> None:
        for rid, slot in self.sched.admit():
            req = self.requests.get(rid)
            if req is None:  # every request failed meanwhile (the runtime went down)
                continue
            if req.swapped is not None:  # its rows come back; its program goes on
                self._swap_in(req)
                continue
            req.slot = slot
            self._share(req)
            try:
                req.program = req.make(slot)
            except BaseException as e:  # noqa: BLE001 - this request fails, the rest go on
                self._fail(req, e)
                continue
            self._advance(req, None)

    def _advance(self, req: Request, value: Any) -> None:
        """Run the program until it asks for a step (or ends)."""
        try:
            item = req.program.send(value)
            while True:
                if req.cancelled:
                    raise StopIteration
                if isinstance(item, int):
                    req.deltas.extend(req.out.push(item))
                    if req.out.finished:  # its stop rules say so: the slot is free at once
                        raise StopIteration
                    item = req.program.send(None)
                elif isinstance(item, SampleRequest):
                    if item.extra is None:
                        got = self.coord.sample_logits(item.logits, item.position, item.sample,
                                                       item.seed)
                    else:
                        got = self.coord.sample_output(item.logits, item.position, item.sample,
                                                       item.seed, item.extra)
                    item = req.program.send(got)
                else:
                    req.pending = item
                    return
        except StopIteration:
            if req.in_flight == 0:
                self._end(req)
            else:
                req.cancelled = True  # ends when its steps in flight are back
        except BaseException as e:  # noqa: BLE001 - this request fails, the rest go on
            self._fail(req, e)
            if isinstance(e, ShardFailure) and e.runtime_down:
                self._fail_all(e)

    def _ready(self, req: Request) -> bool:
        return req.pending is not None and req.waits is None and not req.cancelled and \
            req.swapped is None and not req.stale_state  # (a swapped one waits to be
        # admitted again; a stale one for its steps in flight, then runs again)

    def _send_ready(self) -> None:
        busy_groups = {s.group for s in self.steps.values() if s.group is not None}
        running = [self.requests[rid] for rid in self.sched.running]
        for g in range(self.sched.config.micro_batches):
            if g in busy_groups or len(self.steps) >= MAX_IN_FLIGHT:
                continue
            ready = [r for r in running if self._ready(r) and self.sched.group_of(r.rid) == g]
            if ready:
                self._send(ready, g)
        # prefill chunks nobody waits for may follow at once (a long prompt's pipeline), while
        # every micro-batch keeps a place in the chain
        running = [self.requests[rid] for rid in self.sched.running if rid in self.requests]
        busy = {s.group for s in self.steps.values() if s.group is not None}
        idle = len({self.sched.group_of(r.rid) for r in running} - busy)
        while len(self.steps) + idle < MAX_IN_FLIGHT:
            free = [r for r in running if self._ready(r) and (
                not r.pending.wait or self._last_chunk_follows(r))]
            if not free or not self._send(free, None):
                break  # (none of them got blocks for its step: they wait for the next round)
        self._send_ahead()

    @staticmethod
    def _last_chunk_follows(r: Request) -> bool:
        """Whether `r`'s pending step is a prompt's last chunk (it samples the first token)
        that may follow the sequence's own earlier chunks, still in flight, into the chain, as
        they followed each other: its output is waited for, theirs are not, so nothing it
        needs is missing, and the first token does not wait for a round trip of the chain."""
        step = r.pending
        return (r.in_flight > 0 and r.ahead is None and step.sample is not None
                and step.draft is None and step.ask is None and step.tree is None
                and step.pos + len(step.tokens) == r.prompt_tokens)

    def _send(self, ready: list[Request], group: int | None) -> bool:
        """Send one step of those of `ready` the plan takes and the pool has blocks for;
        whether a step went out."""
        by_rid = {r.rid: r for r in ready}
        chosen = self.sched.plan([Ready(r.rid, r.pending.rows,
                                        r.pending.sample is not None and r.pending.wait)
                                  for r in ready])
        reqs = self._reserve([by_rid[rid] for rid in chosen])
        if not reqs:
            return False
        try:
            sid = self._send_step(reqs, [r.pending for r in reqs])
        except ShardFailure as e:
            for r in reqs:
                self._fail(r, e)
            if e.runtime_down:
                self._fail_all(e)
            return False
        self._sent(_Step(sid, reqs, group, [r.pending for r in reqs]))
        for r in reqs:
            step, r.pending = r.pending, None
            r.in_flight += 1
            if r.prompt is not None and step.pos + step.rows <= len(r.prompt):
                r.prefilled = step.pos + step.rows  # (a prefill chunk: prompt rows)
            if step.wait:
                r.waits = sid
            else:
                self._advance(r, None)
            if step.error is not None:  # its grammar mask failed: the sequence fails
                self._fail(r, step.error)
        return True

    def _send_step(self, reqs: list[Request], steps: list[StepRequest]) -> int:
        """Send the step of `reqs`' segments `steps`, each feeding the draft where it does
        (`_feed`), parked where it may (`_parks`); its sid."""
        feeds = [_feed(r, step) for r, step in zip(reqs, steps)]
        park = _parks(reqs, steps, feeds)
        sid = self.coord.send_step([(r.slot, step, f) for r, step, f in
                                    zip(reqs, steps, feeds)], park)
        self.stats.parked += park and any(f is not None for f in feeds)
        return sid

    def _sent(self, st: _Step) -> None:
        """Keep a step that went out, and count it."""
        self.steps[st.sid] = st
        self.stats.steps += 1
        self.stats.segments += len(st.reqs)
        self.stats.rows += sum(step.rows for step in st.sent)
        self.stats.widest = max(self.stats.widest, len(st.reqs))
        self.stats.most_in_flight = max(self.stats.most_in_flight, len(self.steps))
        if self.step_observer is not None:
            self.step_observer(len(st.reqs))

    # ---- decode lookahead -----------------------------------------------------------------------
    def _send_ahead(self) -> None:
        """Behind a micro-batch's decode step in flight, its next decode step, sent before the
        tokens it takes are known: the shard, first and last, takes them on the device
        (`shards.decode_ahead`), so the device does not wait, each token, for a result's round
        trip through this loop. When the step comes back, each program asks for exactly that
        next step (`_adopt`) and waits for the one in flight. Only where every sequence of the
        step decodes one plainly sampled token (no draft, logprobs or logits processors) and
        may go on after it (its max_tokens and context), the pool has the next row's blocks
        without preempting anyone, and no other sequence of the micro-batch waits to join a
        step."""
        if not self.look_ahead:
            return
        for st in list(self.steps.values()):
            if len(self.steps) >= MAX_IN_FLIGHT:
                return
            if st.group is None or st.behind or any(
                    o.group == st.group and o.sid > st.sid for o in self.steps.values()):
                continue
            if not all(self._may_look_ahead(r, st.sid, step) for r, step in
                       zip(st.reqs, st.sent)) or any(
                    self._ready(r) and self.sched.group_of(r.rid) == st.group
                    for r in self.requests.values() if r.rid in self.sched.running) or \
                    not self.sched.can_grow_all({r.rid: step.pos + 2
                                                 for r, step in zip(st.reqs, st.sent)}):
                continue
            ahead = [dataclasses.replace(step, tokens=[0], pos=step.pos + 1, prev=st.sid)
                     for step in st.sent]
            for r, a in zip(st.reqs, ahead):
                self.sched.grow(r.rid, a.pos + a.rows)
            try:
                sid = self._send_step(st.reqs, ahead)
            except ShardFailure as e:
                for r in st.reqs:
                    self._fail(r, e)
                if e.runtime_down:
                    self._fail_all(e)
                return
            st.behind = True
            self._sent(_Step(sid, list(st.reqs), st.group, ahead))
            self.stats.ahead += 1
            for r, a in zip(st.reqs, ahead):
                r.in_flight += 1
                r.ahead = (sid, a)

    def _may_look_ahead(self, r: Request, sid: int, step: StepRequest) -> bool:
        """Whether the sequence's next decode step may follow its step `sid` (`step`) now: a
        decode step past its prompt (never a prefill chunk, even one of one token: the next
        step may then differ, and ask for the row again) of a sequence that does not
        speculate, or whose next step the speculation policy has made plain (`plain_next`:
        it feeds the draft all the same). Where the model's state is recurrent, only a
        sequence that never speculates: a policy that turns to speculating would ask for that
        row again, in a verify step, and the state cannot take it twice."""
        plain = r.feed is None and r.out.progress.spec is None
        return (r.waits == sid and r.ahead is None and not r.cancelled and not r.done
                and _plain_decode(step)
                and step.pos >= r.prompt_tokens
                and step.pos + 2 <= self.sched.config.slot_tokens
                and len(r.out.progress.generated) + 1 < r.out.params.max_tokens
                and (plain or (not (self.recurrent and r.speculates)
                               and r.plain_next is not None and r.plain_next())))

    def _adopt(self, r: Request, token: int | None) -> None:
        """After its program took a step's output (`token`): if the step it asks for now is its
        lookahead step in flight, it waits for that one instead of sending it."""
        if r.ahead is None:
            return
        sid, a = r.ahead
        r.ahead = None
        p = r.pending
        if p is not None and not r.cancelled and _plain_decode(p) and p.tokens == [token] \
                and p.pos == a.pos and p.seed == a.seed and p.sample == a.sample \
                and p.want_logits == a.want_logits:
            r.pending, r.waits = None, sid
        else:  # (it stopped, or asks for something else: the step's output is dropped)
            self.stats.ahead_dropped += 1
            if self.recurrent and p is not None and not r.cancelled and not r.done:
                # its state took the row the program now asks for otherwise: it is stale, and
                # the sequence runs again from its tokens once the step is back (`_dispatch`)
                log.warning("request %d: its next step (%d rows at %d) is not the one sent "
                            "ahead; its recurrent state took that row, so it runs again from "
                            "its tokens", r.rid, len(p.tokens), p.pos)
                r.stale_state = True

    # ---- KV blocks ----------------------------------------------------------------------------
    def _reserve(self, reqs: list[Request]) -> list[Request]:
        """Grow each sequence's block table to cover its step, oldest first; the ones the pool
        cannot take now wait. When the pool is full, the youngest running sequence with no
        step in flight is preempted (possibly the one asking); a sequence that alone cannot
        fit the pool fails."""
        out: list[Request] = []
        for r in reqs:
            if r.pending is None or r.program is None or r.done or \
                    r.rid not in self.sched.running:
                continue  # preempted for an earlier one of `reqs`
            need = r.pending.pos + r.pending.rows
            while not self.sched.can_grow(r.rid, need):
                victim = self._victim(out)
                if victim is None or (victim is r and not self._others_hold_blocks(r)):
                    break
                self._preempt(victim)
                if victim is r:
                    break
            if r.program is None or r.done or r.rid not in self.sched.running:
                continue  # preempted
            if not self.sched.can_grow(r.rid, need):
                if not self._others_hold_blocks(r):
                    self._fail(r, MemoryError(
                        f"the KV pool ({self.sched.total_blocks} blocks of "
                        f"{self.sched.config.block_tokens} tokens) cannot hold this sequence's "
                        f"{need} tokens: raise kv_blocks or kv_cache_gb, or lower max_context"))
                continue  # waits for blocks (held by sequences with steps in flight)
            self.sched.grow(r.rid, need)
            out.append(r)
        return out

    def _share(self, req: Request) -> None:
        """Prefix sharing between live sequences: a new sequence whose prompt starts with rows a
        running one has prefilled (or restored) takes their blocks by reference (the partial
        last one copied) and prefills only the rest. Only up to a chunk boundary of its prompt
        and within the other's prefill, so the rows are exactly the ones it would compute: a
        row's value depends on its chunk, and chunk boundaries on the tokens alone."""
        if not self.share_prefixes or req.prompt is None or req.cached is None:
            return
        best, src = 0, None
        for run in self.sched.running.values():
            other = self.requests.get(run.rid)
            if other is None or other is req or other.prompt is None or other.program is None:
                continue
            n = min(other.prefilled, len(req.prompt) - 1)
            common = next((i for i in range(n) if req.prompt[i] != other.prompt[i]), n)
            cut = max((c for c in req.cuts if c <= common), default=0)
            if cut > best:
                best, src = cut, other
        # (not below a resident prefix shared at admission: its own blocks start past that)
        pre = self.sched.pre_shared.get(req.slot, ("", 0))[1]
        if src is not None and best >= self.sched.config.block_tokens and \
                best > max(req.cached(req.prompt), pre):  # (else the cache restores as much)
            self.sched.share(req.rid, src.slot, best)
            req.shared = req.prefilled = best
            req.share_writes = frozenset(sid for sid, st in self.steps.items()
                                         if any(r is src for r in st.reqs))
            self.stats.shared_tokens += best

    def _others_hold_blocks(self, r: Request) -> bool:
        return any(rid != r.rid and run.blocks for rid, run in self.sched.running.items())

    def _victim(self, keep: list[Request]) -> Request | None:
        """The youngest running sequence that can be preempted now (no step in flight, none
        waited for, not in `keep`)."""
        order = sorted(self.sched.running.values(), key=lambda x: -x.order)
        for run in order:
            r = self.requests.get(run.rid)
            if r is not None and r not in keep and r.in_flight == 0 and r.waits is None \
                    and not r.done and r.program is not None:
                return r
        return None

    def _preempt(self, req: Request) -> None:
        """Take back the sequence's blocks: by swap where it can be (`_swap_out`), else by
        re-prefill (`_restart`); either way it waits ahead of the requests that wait."""
        req.preempted += 1
        self.stats.preemptions += 1
        if not self._swap_out(req):
            self._restart(req)

    def _swap_why_not(self, req: Request) -> str | None:
        """Why the sequence cannot be swapped out now, or None."""
        if self.host is None:
            return "no host KV pool (kv_host_blocks 0)"
        if req.feed is not None or req.out.progress.spec is not None:
            return "it feeds the draft or speculates (the draft's context is not swapped)"
        if self.sched.copies.get(req.slot):
            return "its shared-prefix block copy was not made yet"
        if req.pending is None:
            return "it asks for no step"
        if not req.share_writes.isdisjoint(self.steps):  # (a swap reaches every shard at once,
            # ahead of steps still on their way down the chain)
            return "the live prefix it took is still being written by steps in flight"
        if not self.host.can_allocate(req.pending.pos):
            return (f"the host KV pool has {self.host.free_blocks} of {self.host.num_blocks} "
                    f"blocks free")
        return None

    def _swap_out(self, req: Request) -> bool:
        """Copy the rows the sequence's blocks hold (all its steps are back: [0, pos) of the
        step it asks for) to host blocks on every shard, then free its device blocks; it keeps
        its slot and program. False (nothing changed) where it cannot be swapped."""
        why = self._swap_why_not(req)
        if why is not None:
            if self.host is not None:
                log.info("request %d: not swapped out (%s): it will be prefilled again", req.rid,
                         why)
            return False
        rows = req.pending.pos
        need = req.pending.pos + req.pending.rows  # its step's rows, when it comes back
        if self.sched.pool.blocks_for(need) > self.sched.total_blocks:
            need = rows  # (`_reserve` then fails it, as it would have)
        # host memory: RAM-tier snapshots are evicted, least recently used first, to make room
        try:
            held = self.host_pool is None or self.host_pool.hold_swap(
                req.rid, self.host.blocks_for(rows))
        except ShardFailure as e:  # (dropping the snapshots on the shards failed)
            log.warning("request %d: no room made in host memory (%s): it will be prefilled "
                        "again", req.rid, e)
            return False
        if not held:
            log.info("request %d: not swapped out (host memory full: %s of %s bytes per shard "
                     "held by swapped sequences): it will be prefilled again", req.rid,
                     list(self.host_pool.swapped_bytes()), list(self.host_pool.capacity))
            return False
        self.host.allocate(req.rid, rows)
        blocks = self._copy_blocks(req, "out")
        if blocks is None:
            self._drop_host(req, False)
            return False
        req.swapped = rows
        req.rows_gone = True  # (until a swap-in brings them back)
        self.sched.swap_out(req.rid, need)
        self.stats.swapped_out += 1
        self.stats.host_blocks = self.host.num_blocks - self.host.free_blocks
        log.info("request %d preempted (KV pool full): %d rows (%d blocks) swapped out to host "
                 "memory", req.rid, rows, blocks)
        return True

    def _swap_in(self, req: Request) -> None:
        """The swapped sequence is admitted again (its slot's table covers its next step): its
        rows come back from the host blocks into its new device blocks on every shard before
        that step goes out. If the copy fails, it runs again from its tokens instead."""
        blocks = self._copy_blocks(req, "in")
        self._drop_host(req, blocks is not None)  # (a swap-in frees them on the shards)
        if blocks is None:
            self._restart(req)  # (its program closes with `rows_gone` still set)
            return
        req.rows_gone = False
        self.stats.swapped_in += 1
        log.info("request %d resumed: %d blocks swapped in from host memory", req.rid, blocks)

    def _copy_blocks(self, req: Request, direction: str) -> int | None:
        """Copy the sequence's blocks between its device table and its host table on every
        shard (`direction` "out" or "in", `Coordinator.kv_swap`); the blocks copied, or None
        if a shard failed (the sequence then runs again from its tokens)."""
        pairs = list(zip(self.sched.pool.table(req.slot), self.host.table(req.rid)))
        try:
            if pairs:
                self.coord.kv_swap(direction, pairs)
        except ShardFailure as e:
            log.warning("request %d: swap-%s failed (%s): it will be prefilled again", req.rid,
                        direction, e)
            return None
        return len(pairs)

    def _drop_host(self, req: Request, swapped_in: bool) -> None:
        """The sequence's host blocks are free (swapped in, or it ended while swapped out or
        its swap failed: then the shards are told to free their memory)."""
        if req.rid not in self.host.tables:
            return
        req.swapped = None
        if not swapped_in and self.coord.failed is None:  # (a runtime that is down frees all)
            drop = [[-1, h] for h in self.host.table(req.rid)]
            try:
                if drop:
                    self.coord.kv_swap("drop", drop)
            except ShardFailure as e:  # (the runtime may be down: nothing to free then)
                log.warning("request %d: freeing its host blocks failed: %s", req.rid, e)
        self.host.free(req.rid)
        if self.host_pool is not None:
            self.host_pool.release_swap(req.rid)
        self.stats.host_blocks = self.host.num_blocks - self.host.free_blocks

    def _restart(self, req: Request, why: str = "KV pool full", reprefill: bool = True) -> None:
        """Take back the sequence's slot and blocks; it runs again from its prompt and the
        tokens it generated, ahead of the requests that wait. `reprefill`: counted in
        `stats.reprefills` (a preemption); a restart for another reason (`why`) is counted by
        its caller."""
        prog, req.program, req.pending = req.program, None, None
        try:
            prog.close()  # its cleanup (draft context, cache pins) runs now
        except BaseException as e:  # noqa: BLE001 - reported, the request goes on
            log.warning("request %d: cleanup on restart failed: %s", req.rid, e)
        req.rows_gone = False  # (its next program computes its rows again)
        if reprefill:
            self.stats.reprefills += 1
        req.prompt_tokens = req.base_tokens + len(req.out.progress.generated)
        if req.prompt is not None:  # it runs again from these tokens
            req.prompt = req.prompt[:req.base_tokens] + list(req.out.progress.generated)
        req.prefilled = req.shared = 0
        req.share_writes = frozenset()
        log.info("request %d restarted (%s): it runs again from %d tokens", req.rid, why,
                 req.prompt_tokens)
        self.sched.requeue(req.rid, req.prompt_tokens)

    def _dispatch(self, sid: int) -> None:
        step = self.steps.pop(sid, None)
        if step is None:  # (a step of requests failed meanwhile)
            self.coord.forget_steps([sid])
            return
        try:
            outs = self.coord.step_outputs(sid)
        except ShardFailure as e:
            for r in step.reqs:
                r.in_flight -= 1
                r.waits = None
                self._fail(r, e)
            if e.runtime_down:
                self._fail_all(e)
            return
        for r, out, sent in zip(step.reqs, outs, step.sent):
            r.in_flight -= 1
            if r.rid in self.sched.running:  # (its first step's block copies are made)
                self.sched.copied(r.slot)
            if r.done:
                continue
            if out.error is not None:  # (this sequence only: the step's others go on)
                if r.waits == sid:
                    r.waits = None
                self._fail(r, ShardFailure(out.error, runtime_down=False))
                continue
            if sent.on_out is not None and r.waits != sid and not r.cancelled:
                try:  # (a prefill chunk's output read on the way: `StepRequest.on_out`)
                    sent.on_out(out, sid)
                except Exception as e:  # noqa: BLE001 - this request fails, the rest go on
                    self._fail(r, e)
                    continue
            if r.waits == sid:
                r.waits = None
                if not r.cancelled:
                    self._advance(r, out)
                self._adopt(r, out.token)
            if r.cancelled and r.in_flight == 0 and not r.done:
                self._end(r)
            elif r.stale_state and r.in_flight == 0 and not r.done:
                r.stale_state = False
                self.stats.stale_restarts += 1
                self._restart(r, "its recurrent state took a row sent ahead", reprefill=False)

    # ---- endings ------------------------------------------------------------------------------
    def _fail(self, req: Request, e: BaseException) -> None:
        if req.done:
            return
        if req.error is None:  # (the first failure says why: a lookahead step behind it fails too)
            req.error = e
        if req.in_flight == 0:
            self._end(req)
        else:
            req.cancelled = True

    def _fail_all(self, e: BaseException) -> None:
        """The runtime is down: every request fails (its steps in flight are lost with it)."""
        self.steps.clear()
        self.coord.forget_steps()
        for req in list(self.requests.values()):
            req.in_flight = 0
            if req.error is None:
                req.error = e
            self._end(req, admitted=req.rid in self.sched.running)
        for rid, _ in list(self.sched.waiting):
            self.sched.cancel_waiting(rid)
        self.held.clear()

    def _end(self, req: Request, admitted: bool = True) -> None:
        if req.done:
            return
        req.done = True
        req.pending = None
        req.deltas.extend(req.out.close())
        if req.program is not None:
            try:
                req.program.close()  # its cleanup (draft ownership, cache pins) runs now
            except BaseException as e:  # noqa: BLE001 - reported on the request
                log.warning("request %d: cleanup failed: %s", req.rid, e)
        if admitted and req.rid in self.sched.running:
            self.sched.release(req.rid)
        if req.swapped is not None:  # ended while swapped out: its slot and host blocks
            self.sched.cancel_waiting(req.rid)
            self._drop_host(req, False)
        self.requests.pop(req.rid, None)

    def check(self) -> None:
        """Every slot is held by a live request, every live step by its requests (tests)."""
        self.sched.check()
        assert set(self.sched.running) <= set(self.requests)
        assert {rid for rid, r in self.requests.items() if r.swapped is not None} == \
            set(self.sched.swapped), "swapped requests and swapped slots differ"
        if self.host is not None:
            self.host.check_integrity()
            assert set(self.host.tables) == set(self.sched.swapped), "host blocks leaked"
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            assert set(self.host_pool.swapped) == set(self.sched.swapped), \
                "host memory held for sequences not swapped out"
        for st in self.steps.values():
            assert all(r.in_flight > 0 for r in st.reqs)


def _feed(r: Request, step: StepRequest) -> int | None:
    """The draft context `r`'s segment of `step` feeds: its own, but for a plain decode step
    past its prompt whose rows the draft will not read (`Request.taps`)."""
    if r.feed is None or r.taps is None:
        return r.feed
    return r.feed if r.taps(step.pos, _plain_decode(step) and step.pos >= r.prompt_tokens) \
        else None


def _parks(reqs: list[Request], steps: list[StepRequest], feeds: list[int | None]) -> bool:
    """Whether a step may park its feature rows on the shards (`shards.parked_rows`): every
    sequence of it decodes one plain row, and every one that feeds the draft (`feeds`, each
    segment's draft context) may park it (`Request.may_park`). A step none of whose segments
    feeds goes out parked too: it parks nothing, and leaves the rows other steps parked on
    the shards (a step not parked has them sent)."""
    return all(_plain_decode(step) for step in steps) and all(
        r.may_park is not None and step.pos >= r.prompt_tokens and r.may_park()
        for r, step, feed in zip(reqs, steps, feeds) if feed is not None)


def _plain_decode(step: StepRequest) -> bool:
    """A one-row decode step whose token the last shard samples on its own (`_send_ahead`)."""
    return (len(step.tokens) == 1 and step.sample is not None and step.wait
            and step.draft is None and step.ask is None and step.extra is None
            and step.plp is None and step.kept is None
            and step.tree is None and step.q is None and step.then is None
            and step.error is None)
