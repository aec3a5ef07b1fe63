"""Chain driving: steps go to the first shard, their results come back from the last one
and wait, by step id, until the batch reads them (`runtime.batching.StepChain`).

`StepDriver` is one part of `runtime.coordinator.Coordinator`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
from layersplit.ipc.messages import message, segment
from layersplit.ipc.sockets import send
from layersplit.ipc.transport import zmq_array
from layersplit.runtime.decoding import LATE_MASK
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import StepOutput, StepRequest
from layersplit.runtime.shard_group import _Shard
from layersplit.shards.sampling_params import SamplingParams

log = logging.getLogger("layersplit.runtime.coordinator")  # (one name for the coordinator's parts)


class StepDriver:
    """Steps sent (`send_step`), waited for (`wait_steps`) and read (`step_outputs`); single
    steps (`forward`) and samples of stored logits (`sample_output`). Owns `_in_flight`,
    `_done`, `_back`, `_feat_sids`, `_parked` and `_unparking`."""

    def send_step(self, segs: Sequence[tuple[int, StepRequest, int | None]],
                  park: bool = False) -> int:
        """Send one step, a segment per (KV slot, request, draft context it feeds or None);
        returns its sid. Its outputs are collected with `wait_steps` and `step_outputs`.
        `park`: the shards keep its feature rows until a step that is not parked
        (`shards.parked_rows`; every segment a plain decode step)."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        wire, ids, late = [], [], []
        sched = self.batcher.sched
        for k, (slot, r, feed) in enumerate(segs):
            feed = feed if self.feeding else None
            extra = r.extra
            if r.sample is not None and extra is not None and LATE_MASK in extra:
                late.append((k, r, extra[LATE_MASK]))  # (computed once the step is on its way)
                extra = {**extra, LATE_MASK: True}
            sample = None if r.sample is None else {**r.sample.wire(), "seed": r.seed,
                                                    **(extra or {})}
            ask = None
            if r.ask is not None and feed is not None:  # the proposal of the last verdict
                ask = {**r.ask, "after": self._feat_sids.get(feed, 0)}
            if feed is not None:
                self._feat_sids[feed] = sid
            wire.append(segment(slot, r.pos, len(r.tokens), sample, r.want_logits,
                                None if r.draft is None else [int(t) for t in r.draft], feed,
                                r.tree, r.kept, r.then if feed is not None else None, ask,
                                r.plp, sched.table_update(slot), sched.copy_update(slot),
                                r.q, r.prev))
            ids.extend(r.tokens)
        first = segs[0][1]
        kind = ("verify" if first.draft is not None or first.ask is not None else
                "prefill" if len(first.tokens) > 1 else "decode")
        rows = sum(r.rows for _, r, _ in segs)
        if self.trace is not None:  # (as it goes: the first shard may take it first)
            self.trace("send", sid, kind=kind, rows=rows, seqs=len(wire))
        msg = message("step", sid=sid, seqs=wire, act=None)
        if park and self.feeding:
            msg["park"] = True
            self._parked.update((feed, sid) for _, _, feed in segs if feed is not None)
        elif self._parked:  # every shard sends the rows parked before it as it runs it: they
            self._unparking.add(sid)  # are out once its result is back (`_stash`)
        self._steps.send(msg, np.array(ids, dtype=np.int64))
        ahead = [(d, k, n) for d, _, k, _, n in self._in_flight.values()]
        self._in_flight[sid] = (self.deadlines.deadline(kind, rows, time.monotonic(), ahead),
                                time.perf_counter(), kind, len(wire), rows)
        for k, r, make_mask in late:  # while the shards run the step
            try:
                mask = make_mask()
            except Exception as e:  # noqa: BLE001 - that sequence fails (`Batcher._send`)
                mask, r.error = None, e
            send(self.shards[-1].sock, message("mask", sid=sid, seg=k, mask=mask))
        return sid

    def forward(self, tokens: Sequence[int], pos: int, sample: SamplingParams | None, seed: int,
                want_logits: bool = False, draft: Sequence[int] | None = None,
                tree: Sequence[int] | None = None, kept: Sequence[int] | None = None,
                slot: int = 0) -> StepOutput:
        """One step of one sequence in `slot`, waited for (the `runtime.generate.Engine`
        protocol: traces and tests drive single steps with it)."""
        req = StepRequest(list(tokens), pos, sample, seed, want_logits,
                          None if draft is None else list(draft),
                          tree=None if tree is None else list(tree),
                          kept=None if kept is None else list(kept))
        try:  # (a slot driven here, outside admission: its table grows as it goes)
            self.batcher.sched.hold_slot(slot, pos + req.rows, new=pos == 0)
        except MemoryError as e:
            raise ValueError(f"step at {pos} of slot {slot}: {e}") from None
        sid = self.send_step([(slot, req, 0 if self.feeding else None)])
        if sid not in self._done:
            self._wait(lambda s, m: False, self._in_flight[sid][0], f"step {sid}", sid,
                       until=lambda: sid in self._done, step=sid)
        out = self.step_outputs(sid)[0]
        if out.error is not None:
            raise ShardFailure(out.error, runtime_down=False)
        return out

    def table_update(self, slot: int) -> dict[str, Any] | None:
        """The block-table change a message about `slot` carries (`runtime.scheduler`)."""
        return self.batcher.sched.table_update(slot)

    def parked(self, context: int) -> bool:
        """Whether rows of the draft's `context` may still be parked on the shards: its last
        parked step is later than every step not parked whose result is back (a round's
        proposal would wait for them: its sequence runs a plain step first)."""
        return context in self._parked

    def new_context(self, context: int) -> None:
        """A new sequence takes the draft's `context` (before its `draft_begin`): rows of the
        sequence before that the shards still park go out first (a parked run would otherwise
        go on into the new sequence's positions), and the last step that fed it is forgotten
        (the new sequence's snapshots wait for its own rows, not for a step of the one before
        still on its way)."""
        sid = self._parked.get(context)
        if sid is not None and sid in self._in_flight:  # (the sequence before's lookahead
            # step, parked, still on its way: it parks its rows first, then they go out)
            self._wait(lambda s, m: False, self._in_flight[sid][0], f"step {sid}", sid,
                       until=lambda: sid not in self._in_flight, step=sid)
        if sid is not None:
            self.unpark()
        self._feat_sids.pop(context, None)

    def unpark(self) -> None:
        """Have the shards send the draft every feature row they parked (what reads the
        draft's rows outside a round or a snapshot: `draft_features`, after this)."""
        keep = {c: s for c, s in self._parked.items() if s in self._in_flight}  # (parked
        # steps on their way park their rows after the unpark)
        self.call_all(lambda sh: message("unpark"), what="unpark")
        self._parked = keep

    def feat_sid(self, context: int) -> int:
        """The last step that sent feature rows to the draft's `context` (a proposal or a
        snapshot of its sequence waits for them)."""
        return self._feat_sids.get(context, 0)

    def wait_steps(self) -> list[int]:
        """Wait until at least one step in flight is back; returns the sids of those back."""
        self._ensure_up()
        if not self._done and self._in_flight:
            oldest = min(self._in_flight)
            self._wait(lambda s, m: False, self._in_flight[oldest][0], f"step {oldest}",
                       until=lambda: bool(self._done), step=oldest)
        return list(self._done)

    def forget_steps(self, sids: Sequence[int] | None = None) -> None:
        """Drop what is known of these steps (all: the runtime is down); a late result of one
        is then discarded."""
        for sid in list(self._in_flight) + list(self._done) if sids is None else sids:
            self._unparking.discard(sid)
            self._in_flight.pop(sid, None)
            self._done.pop(sid, None)
            self._back.append(sid)

    def _stash(self, sh: _Shard, msg: dict[str, Any], frames: Any) -> bool:
        """Keep the result (or the error) of a step in flight for `step_outputs`; False if the
        message is about something else."""
        sid = msg.get("sid")
        if sh.index < 0 or sid not in self._in_flight:
            return False
        _, t0, kind, nseg, rows = self._in_flight[sid]
        if msg["type"] == "result" and sh is self.shards[-1]:
            if self.trace is not None:
                self.trace("result", sid)
            self.deadlines.observe(kind, rows, time.perf_counter() - t0)
            t = frames if frames is None or isinstance(frames, np.ndarray) else \
                zmq_array(msg, frames)
            self._done[sid] = (msg, None if t is None else t.copy(), nseg)
            if sid in self._unparking:
                self._unparking.discard(sid)
                self._parked = {c: s for c, s in self._parked.items() if s > sid}
        elif msg["type"] == "error" and msg["code"] != "feed_lost":
            self._unparking.discard(sid)
            self._done[sid] = ShardFailure(msg["message"], runtime_down=False)
            self._void(sid)
        else:
            return False
        del self._in_flight[sid]
        self._back.append(sid)
        if self.step_observer is not None and msg["type"] == "result":
            self.step_observer(kind, time.perf_counter() - t0)
        return True

    def _void(self, sid: int) -> None:
        """A step failed on a split runtime that decodes ahead: the first shard may hold the
        lookahead step that takes its tokens (`ipc.token_board`), which now fails at once."""
        if not self.board or self.shards[0].sock.closed:
            return
        try:
            send(self.shards[0].sock, message("void", sid=sid))
        except zmq.ZMQError as e:
            log.warning("could not tell the first shard step %d failed (%s): a lookahead "
                        "step behind it fails after its wait", sid, e)

    def step_outputs(self, sid: int) -> list[StepOutput]:
        """The outputs of a step that is back, one per segment; raises its failure."""
        got = self._done.pop(sid)
        if isinstance(got, ShardFailure):
            raise got
        msg, logits, nseg = got
        if len(msg["outs"]) != nseg:
            raise self.fail(f"the last shard returned {len(msg['outs'])} outcomes for a step of "
                             f"{nseg} sequences")
        outs, row = [], 0
        for o in msg["outs"]:
            lg = kept_lg = None
            if o["logits"]:  # a row per token emitted: kept draft tokens' rows, then the last
                n = 1 + (o["accepted"] if isinstance(o["accepted"], int) else 0)
                if logits is None or row + n > len(logits):
                    raise self.fail("the last shard sent a result without its logits")
                lg = logits[row + n - 1].copy()
                kept_lg = logits[row:row + n - 1].copy() if n > 1 else None
                row += n
            path = o["path"]
            if path is not None and (len(path) != o["accepted"] or not all(
                    isinstance(j, int) for j in path)):
                raise self.fail(f"the last shard returned the tree path {path[:40]} for "
                                 f"{o['accepted']} kept tokens")
            err = o.get("error")
            if err is not None and (not isinstance(err, str) or o["token"] is not None):
                raise self.fail("the last shard returned an outcome with both a token and an "
                                "error, or an error that is not text")
            outs.append(StepOutput(o["token"], lg, o["accepted"], path, o["asked"], o["lp"],
                                   o["plp"], err, kept_lg))
        if logits is not None and row != len(logits):
            raise self.fail(f"the last shard returned {len(logits)} logits rows for {row}")
        return outs

    def sample_logits(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int) -> int:
        return self.sample_output(logits, position, sample, seed).token

    def sample_output(self, logits: np.ndarray, position: int, sample: SamplingParams,
                      seed: int, extra: dict | None = None) -> StepOutput:
        """Draw the token at `position` from stored logits on the last shard (an exact
        prefix-cache hit), with the optional sample fields `extra` (`shards.sampling`)."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        last = self.shards[-1]
        if extra is not None and LATE_MASK in extra:  # (nothing runs first: the mask goes with it)
            extra = dict(extra)
            mask = extra.pop(LATE_MASK)()
            if mask is not None:
                extra["mask"] = mask
        send(last.sock, message("sample", sid=sid, position=position,
                                sample={**sample.wire(), "seed": seed, **(extra or {})}),
             [np.ascontiguousarray(logits, dtype=np.float32)])
        msg, _ = self._wait(lambda s, m: s is last and m["type"] == "result" and m["sid"] == sid,
                            time.monotonic() + self.config.step_timeout, f"sample {sid}", sid)
        o = msg["outs"][0]
        if o.get("error") is not None:
            raise ShardFailure(str(o["error"]), runtime_down=False)
        return StepOutput(int(o["token"]), lp=o.get("lp"))
