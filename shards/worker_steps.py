"""A shard's steps: each checked against its configuration, held while it waits for the
draft's proposals or the last shard's tokens (decode lookahead), run through the shard's
layers, passed on to the next shard, and its tapped rows fed to the draft process.

`StepRunner` is one part of `shards.worker.ShardServer`; the last shard's sampling of a step
is `shards.worker_sampling`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import zmq
from layersplit.ipc.messages import ProtocolError, error, message
from layersplit.ipc.sockets import recv
from layersplit.shards import hybrid_prewarm
from layersplit.shards.asked import DRAFT_WAIT_S, asked, check_drafted, fill, ready
from layersplit.shards.executor import Segment, group_rows
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.parked_rows import Run, adjacent, feature_messages
from layersplit.shards.sampling import has_processors
from layersplit.shards.spec_tree import check_path, check_q, check_q_form, check_tree
from layersplit.shards.worker_sampling import _check_sample
from layersplit.shards.worker_setup import FEED_ROWS

log = logging.getLogger("layersplit.shard")
# the first shard holds a lookahead step this long for the tokens of the step it follows (a step
# that fails on its way is voided by the coordinator at once: this bounds a lost message)
AHEAD_WAIT_S = 60.0


class StepRunner:
    """Steps in the order they came (`_step`), held (`_run_held`) or queued behind a held one
    (`_run_queued`), checked (`_segments`) and run (`_run_step`); proposals the draft hands
    the first shard (`_on_drafted`); feature rows to the draft (`_send_features`)."""

    def _handle_draft_reply(self, sock: zmq.Socket) -> None:
        """What the draft says on the feed link: proposals it hands the first shard
        (`drafted`, when there is no shared-memory ring for them) or doorbells; anything else
        (it reports refused feature frames to the coordinator itself) is logged."""
        _, msg, _, err = recv(sock)
        if err is None and msg["type"] not in ("drafted", "wake"):
            log.warning("shard %d: the draft process says: %s", self.index,
                        msg.get("message", msg["type"]))
        elif err is not None or msg["type"] == "drafted":
            self._on_drafted(msg, err)

    def _take_proposals(self) -> None:
        """The `drafted` messages in the ring from the draft (a malformed one is consumed
        whole and refused, `_on_drafted`)."""
        assert self.proposals is not None
        while self.proposals is not None and self.proposals.ready():
            try:
                got = self.proposals.poll()
            except ProtocolError as e:
                self._on_drafted(None, e)
                continue
            if got is None:
                return
            msg, _, seq = got
            self.proposals.release(seq)
            self._on_drafted(msg, None if msg["type"] == "drafted" else ProtocolError(
                f"ring message of type {msg['type']!r}, expected 'drafted'"))

    def _on_drafted(self, msg: dict[str, Any] | None, err: Exception | None) -> None:
        """A proposal the draft hands the first shard (`shards.asked`): kept by draft context,
        the latest step's; a held step waiting for it runs at once. A malformed one is
        dropped, and the held step runs without one, saying why."""
        if err is None:
            try:
                check_drafted(msg)
            except ProtocolError as e:
                err = e
        if err is not None:
            feat = msg.get("feat") if isinstance(msg, dict) else None
            why = f"the draft process sent a malformed proposal ({err})"
            self.bad_drafted[feat if isinstance(feat, int) else None] = why
            log.warning("shard %d: %s; the step waiting for it runs without", self.index, why)
        else:
            if self.trace is not None:  # (by the step whose verdict it follows)
                self.trace("drafted", msg["after"])
            last = self.drafted.get(msg["feat"])
            if last is None or last["after"] <= msg["after"]:
                self.drafted[msg["feat"]] = msg
        if self.held is not None:  # at once: the held step is the decode path
            self._run_held()

    def _segments(self, msg: dict[str, Any], x: torch.Tensor | None,
                  asking: bool = False) -> list[Segment]:
        """Check a step's segments against this shard's configuration and its tensor
        (`asking`: the first shard checks a step it will hold for the draft's tokens)."""
        ex = self.executor
        if ex is None or self.out is None:
            raise ProtocolError("step before configure", "unexpected")
        segs, slots, rows = [], set(), 0
        outside: list[str] = []  # segments whose rows their block table does not cover
        for i, seg in enumerate(msg["seqs"]):
            slot, pos, n, draft = seg["slot"], seg["pos"], seg["n"], seg["draft"]
            where = f"step: segment {i}"
            if not 0 <= slot < ex.kv.slots or slot in slots:
                raise ProtocolError(f"{where}: slot {slot} is outside 0..{ex.kv.slots - 1} or "
                                    "repeated in the step")
            if n <= 0 or pos < 0 or pos + n > ex.max_len:
                raise ProtocolError(f"{where}: n={n} pos={pos} outside a context of "
                                    f"{ex.max_len}")
            if draft is not None and (len(draft) != n - 1 or not all(
                    isinstance(t, int) and 0 <= t < self.cfg.vocab_size for t in draft)):
                raise ProtocolError(f"{where}: a verify segment of {n} rows carries {n - 1} "
                                    f"draft token ids of the vocabulary, got {draft!r}"[:300])
            if draft is not None and seg["sample"] is None:
                raise ProtocolError(f"{where}: a verify segment needs its sampling parameters")
            if seg["ask"] is not None and not asking:
                raise ProtocolError(f"{where}: asks for draft tokens, which only the first "
                                    "shard takes, from the draft process")
            tree, kept, then = seg["tree"], seg["kept"], seg["then"]
            try:
                if then is not None and ((draft is None and seg["ask"] is None) or not all(
                        isinstance(then.get(k), int) and not isinstance(then.get(k), bool)
                        and then[k] >= 0 for k in ("n", "tree"))):
                    raise ValueError(f"then={then!r}: not a verify segment's next proposal "
                                     "(n and tree, integers >= 0)")
                if tree is not None:
                    if draft is None:
                        raise ValueError("a token tree without draft tokens")
                    check_tree(tree, n - 1)
                if seg["q"] is not None:
                    if draft is None:
                        raise ValueError("q without draft tokens")
                    if self.model.is_last:  # (the one shard that reads it)
                        check_q(seg["q"], draft, tree, self.cfg.vocab_size)
                    else:
                        check_q_form(seg["q"], len(draft))
                if kept is not None:
                    check_path(kept, pos)
                    if kept and pos - len(kept) - 1 + kept[-1] >= ex.max_len:
                        raise ValueError(f"kept rows reach past the context of {ex.max_len}")
            except ValueError as e:
                raise ProtocolError(f"{where}: {e}") from e
            if seg["sample"] is not None:
                _check_sample(seg["sample"], where, self.cfg.vocab_size)
                if has_processors(seg["sample"]) and (draft is not None or seg["ask"] is not None):
                    raise ProtocolError(f"{where}: logits processors (bias, rep, mask) apply to "
                                        "decode and prefill segments only, not verify ones")
            plp = seg["plp"]
            if plp is not None and not _prompt_lp_ok(plp, n, self.cfg.vocab_size):
                raise ProtocolError(f"{where}: plp={str(plp)[:200]} is not {{targets: up to n "
                                    "token ids, k: 0..vocab, temperature: >= 0}")
            if seg["prev"] is not None and not 0 <= seg["prev"] < msg["sid"]:
                raise ProtocolError(f"{where}: prev={seg['prev']} is not an earlier step than "
                                    f"{msg['sid']}")
            if seg["prev"] is not None and self.model.is_first:  # (the shard that takes it)
                why = ("a lookahead segment (prev) needs a token board shared with the last "
                       "shard (decode_ahead, the first and last shard on one host)"
                       if self.board is None else self.board.error(slot, seg["prev"], n))
                if why is not None:
                    raise ProtocolError(f"{where}: {why}")
            cap = self._check_blocks(ex.kv, slot, seg["blocks"], seg["copy"], where)
            if pos + n > cap:  # (reported after the step's other checks)
                outside.append(f"{where}: rows {pos}..{pos + n} outside the slot's block table "
                               f"of {cap} rows (blocks={str(seg['blocks'])[:120]})")
            slots.add(slot)
            rows += n
            feed = seg["feat"]
            if feed is not None and feed < 0:
                raise ProtocolError(f"{where}: draft context {feed} is negative")
            segs.append(Segment(slot, pos, n, verify=draft is not None, tree=tree,
                                all_logits=draft is not None or plp is not None,
                                taps={} if feed is not None and self.feed is not None else None,
                                feed=feed))
        if rows > self.max_step:
            raise ProtocolError(f"step: {rows} rows exceed the {self.max_step} a step may carry")
        park = msg.get("park", False)
        if park is not False and (park is not True or any(
                seg["n"] != 1 or seg["draft"] is not None or seg["ask"] is not None
                or seg["then"] is not None for seg in msg["seqs"])):
            raise ProtocolError(f"step: park={str(park)[:40]} (true parks a plain decode "
                                "step's feature rows: one row a segment, no draft, ask or then)")
        if x is None:
            raise ProtocolError("step without its tensor")
        if self.model.is_first:
            if x.dtype != torch.int64 or tuple(x.shape) != (rows,):
                raise ProtocolError(f"step: expected {rows} int64 token ids, got {x.dtype} "
                                    f"{tuple(x.shape)}")
            lo, hi = torch.aminmax(x)
            if int(lo) < 0 or int(hi) >= self.cfg.vocab_size:
                raise ProtocolError(f"step: token id outside the vocabulary "
                                    f"0..{self.cfg.vocab_size}")
        elif tuple(x.shape) != (rows, self.cfg.hidden_size):
            raise ProtocolError(f"step: activation shape {tuple(x.shape)} != "
                                f"({rows}, {self.cfg.hidden_size})")
        if outside:
            raise ProtocolError(outside[0])
        return segs

    @staticmethod
    def _check_blocks(kv: PagedKVCache, slot: int, blocks: Any, copy: Any, where: str) -> int:
        """Check a segment's (or snap message's) `blocks` and `copy` (`ipc.messages` SEGMENT)
        against the pool; returns the rows the slot's table covers once they apply."""
        cap = kv.capacity(slot)
        if blocks is not None:
            at, ids = blocks.get("at"), blocks.get("ids")
            why = (f"has fields {sorted(blocks)}, expected at and ids"
                   if set(blocks) != {"at", "ids"} else kv.table_error(slot, at, ids))
            if why is not None:
                raise ProtocolError(f"{where}: blocks {why}")
            cap = (at + len(ids)) * kv.block
        if copy is not None:
            ok = all(isinstance(p, list) and len(p) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b < kv.num_blocks
                for b in p) and p[0] != p[1] for p in copy)
            if not ok or len(copy) > kv.num_blocks:
                raise ProtocolError(f"{where}: copy must be [src, dst] pairs of distinct block "
                                    f"ids 0..{kv.num_blocks - 1}, got {str(copy)[:120]}")
        return cap

    def _apply_blocks(self, msg: dict[str, Any]) -> None:
        """Each segment's block table entries and block copies (checked: `_segments`)."""
        kv = self.executor.kv
        for seg in msg["seqs"]:
            if seg["blocks"] is not None:
                kv.set_table(seg["slot"], seg["blocks"]["at"], seg["blocks"]["ids"])
            if seg["copy"]:
                kv.copy_blocks(seg["copy"])

    def _step(self, msg: dict[str, Any], x: torch.Tensor | None) -> None:
        """Run a step, in the order steps came: one that asks for the draft's proposals is held
        until they come (`shards.asked`), and the steps after it wait behind it. A step that is
        not parked sends the draft every row parked so far first, as it comes and again as it
        runs (the coordinator counts on it to: a round may follow it; it may be held, queued or
        refused, and parked steps queued before it park theirs when they run)."""
        if not msg.get("park"):
            self._send_parked(True)
        if self.held is not None or self.awaiting is not None:
            # (a copy: its ring slot is handed back)
            self.queued.append((msg, None if x is None else x.clone()))
            return
        if self.model.is_first and x is not None and asked(msg):
            # the kept rows move while the draft computes (the step checked first): the step
            # then waits only for its draft tokens
            self._settle_snapshots(self._segments(msg, x, asking=True))
            self._apply_blocks(msg)
            self._move_kept(msg)
            self.held = (msg, x.clone(), time.monotonic())
            self._run_held()
            return
        if self.board is not None and x is not None and self.board.waits(msg["seqs"], msg["sid"]):
            # a lookahead step whose tokens the last shard has not posted yet (`_run_held`)
            self.held = (msg, x.clone(), time.monotonic())
            return
        self._run_timed(msg, x)

    def _run_held(self) -> bool:
        """Run the held step if its proposals came, the draft is gone or the wait is over, then
        the steps queued behind it; returns whether it ran."""
        assert self.held is not None
        msg, x, since = self.held
        waited = time.monotonic() - since
        if not asked(msg):  # a lookahead step: its tokens come from the last shard
            if self.board is not None and self.board.waits(msg["seqs"], msg["sid"]) and \
                    waited < AHEAD_WAIT_S:
                return False
            self.held = None  # (`_segments` says why, when they did not come)
            try:
                self._run_timed(msg, x)
            except Exception as e:  # noqa: BLE001 - reported, the loop goes on
                self._step_failed(msg, e)
            self._run_queued()
            return True
        bad = [self.bad_drafted.pop(k) for k in [None, *(seg["feat"] for seg in msg["seqs"]
                                                          if seg["ask"] is not None)]
               if k in self.bad_drafted]
        gone = self.draft_gone or (bad[0] if bad else None) or (
            None if self.feed is not None else "no link to the draft process")
        if not ready(msg, self.drafted) and gone is None and waited < DRAFT_WAIT_S:
            return False
        self.held = None
        why = gone or f"no proposal within {DRAFT_WAIT_S:.0f} s"
        try:
            self._run_timed(msg, fill(msg, x, self.drafted, why, waited, self.cfg.vocab_size),
                            moved=True)
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            self._step_failed(msg, e)
        self._run_queued()
        return True

    def _run_queued(self) -> None:
        """Run the steps queued behind a held or awaiting step, until one holds again."""
        while self.queued and self.held is None and self.awaiting is None:
            m, t = self.queued.popleft()
            try:
                self._step(m, t)
            except Exception as e:  # noqa: BLE001 - reported, the loop goes on
                self._step_failed(m, e)

    def _on_void(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Step `sid` failed on its way: a lookahead step that waits for its tokens fails now
        instead of at `AHEAD_WAIT_S`."""
        if self.board is not None:
            self.board.void(msg["sid"])

    def _on_draft_gone(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """The coordinator lost the draft process: no proposal will come."""
        self.draft_gone = "the draft process is gone"
        self.drafted.clear()

    def _run_timed(self, msg: dict[str, Any], x: torch.Tensor | None,
                   moved: bool = False) -> None:
        started = self.clock.start()
        try:
            self._run_step(msg, x, moved)
        finally:
            self.clock.stop(started)
            if self.profile is not None:
                self.profile.step()

    def _settle_snapshots(self, segs: list[Segment]) -> None:
        """Before a step writes KV rows: snapshots still copying rows of its slots out finish
        (a new sequence overwrites them)."""
        if self.snapshots is not None:
            for s in segs:
                if s.pos < self.snapshots.pending_end(s.slot):
                    self.snapshots.wait_pending()

    def _move_kept(self, msg: dict[str, Any]) -> None:
        """The rows each sequence's last tree verify step kept go where they belong
        (`shards.spec_tree.kept_moves`), and a hybrid model takes the state of the last row
        kept (`RangeExecutor.before_step`); the step was checked (`_segments`). Rows this shard
        moved as soon as it sampled that step are left out (`shards.early_moves`), and a
        sequence whose early move failed fails the step (RuntimeError)."""
        self.executor.before_steps(self.early.for_step(msg["seqs"]))

    def _run_step(self, msg: dict[str, Any], x: torch.Tensor | None,
                  moved: bool = False) -> None:
        """Run a step (`moved`: its kept rows were moved already, while it was held)."""
        if self.prewarm is not None:  # (no warm-up came: the kernels compiled ahead first)
            hybrid_prewarm.finish(self.prewarm)
            self.prewarm = None
        if not msg.get("park"):
            self._send_parked(True)  # (rows of parked steps that were queued before it)
        segs = self._segments(msg, x)
        if self.host_kv is not None and self.host_kv.retiring:
            self.host_kv.reap()  # (host buffers whose last swap copies have run)
        if not x.is_cuda and self.device.type == "cuda":
            # through pinned memory: the host does not wait for the device to take it
            x = x.pin_memory().to(self.device, non_blocking=True)
        if self.model.is_first and any(seg["prev"] is not None for seg in msg["seqs"]):
            x = self.board.fill(x, msg["seqs"])  # (checked: `_segments`)
        self._settle_snapshots(segs)
        if not moved:
            self._apply_blocks(msg)
            self._move_kept(msg)
        if self.trace is not None:
            self.trace("run", msg["sid"], rows=sum(s.n for s in segs), seqs=len(segs),
                       verify=sum(s.verify for s in segs))
        self.busy = True
        try:
            outs = self.executor.run_segments(x, segs)
        finally:
            self.busy = False
        if self.trace is not None:
            self.trace("queued", msg["sid"])
        fed = [(i, s) for i, s in enumerate(segs) if s.taps]
        if not self.model.is_last:  # the next shard first: the draft waits for rows it needs
            if self.trace is not None:
                self.trace("sent", msg["sid"])  # (as it goes: the next shard may take it first)
            fwd = message("step", sid=msg["sid"], seqs=msg["seqs"], act=None)
            if msg.get("park"):
                fwd["park"] = True
            self.out.send(fwd, outs[0] if len(outs) == 1 else torch.cat(outs))
        # (on the last shard, before the verdict: the draft takes them while it is made;
        # parked ones after the sampling, which the next step waits for, not before it)
        park = bool(msg.get("park"))
        if park and (not self.model.is_last or self._late(msg)):
            self._park_features(msg["sid"], [s for _, s in fed])
            park = False
        elif not park:  # (the rows parked before it went out as it came: `_step`)
            for j, (_, s) in enumerate(fed):
                self._send_features(msg["sid"], s.feed, s.pos, s.n, s.taps, j == len(fed) - 1)
        if not self.model.is_last:
            return
        if self._late(msg):
            self.awaiting = (msg, outs, fed, time.monotonic())  # `_on_mask` goes on
            return
        try:
            self._sample_step(msg, outs, fed)
        finally:
            if park:  # (the tapped rows are the graph's until its next replay: a later step)
                self._park_features(msg["sid"], [s for _, s in fed])

    def _late(self, msg: dict[str, Any]) -> bool:
        """Whether the last shard waits for grammar masks of the step (`late_mask`) that have
        not come yet."""
        sid = msg["sid"]
        return any((sid, i) not in self.late_masks for i, seg in enumerate(msg["seqs"])
                   if seg["sample"] is not None and seg["sample"].get("late_mask"))

    def _send_features(self, sid: int, context: int, pos: int, n: int,
                       taps: Mapping[int, torch.Tensor], step_end: bool) -> None:
        """Rows of the tapped layers, side by side, for the sequence's draft context
        (`context`), in pieces (`_send_runs`); the step's last piece says so (`last`: the draft
        then has all of the step's rows)."""
        if self.feed is None:
            return
        rows = torch.cat([taps[layer] for layer in self.taps], dim=-1)
        self._send_runs([Run(sid, context, pos, [rows[:n]])], step_end)

    def _park_features(self, sid: int, fed: list[Segment]) -> None:
        """Keep a parked step's feature rows on the device (`shards.parked_rows`); all of them
        go to the draft once its buffer is full."""
        if self.feed is None or not fed:
            return
        group = group_rows([s.taps for s in fed])  # (a batched decode step's, all of it)
        whole = ([group[t] for t in self.taps] if group is not None else
                 [adjacent([s.taps[t] for s in fed]) for t in self.taps])
        if all(w is not None for w in whole) and self.parked.room(whole[0].shape[0]):
            self.parked.add_step(sid, [(s.feed, s.pos, s.n) for s in fed], whole)
        else:  # (the sequences' rows apart, or not all in the room left)
            for s in fed:
                if not self.parked.room(s.n):  # (a batch's rows that do not all fit: those
                    self._send_parked(False)  # parked go first, the step's own later)
                self.parked.add(sid, s.feed, s.pos, [s.taps[t] for t in self.taps])
        if self.parked.full:
            self._send_parked(True)

    def _send_parked(self, last: bool) -> None:
        """Send the draft the parked rows, a message per run; `last`: the final one says the
        draft has every step's rows up to its own (nothing is parked then, and the steps
        before sent theirs), else the step that follows says so."""
        if self.parked.count:
            self._send_runs(self.parked.take(), last)

    def _send_runs(self, runs: list[Run], last: bool) -> None:
        """`feat` messages of `runs` to the draft (`parked_rows.feature_messages`), in pieces
        a feed message holds (`_link_draft`: min(max_step, FEED_ROWS) rows)."""
        piece = min(self.max_step, FEED_ROWS)
        for header, rows in feature_messages(runs, piece, list(self.taps), last):
            if self.feed is None or not self._to_draft(header, rows):
                return

    def _to_draft(self, msg: dict[str, Any], rows: torch.Tensor | None = None) -> bool:
        """Send the draft process a message of its feed; a draft that stopped taking them is
        dropped (logged, and the coordinator told): the target's step never waits on it."""
        try:
            self.feed.send(msg, rows)
            return True
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("shard %d: the draft process takes no feature rows (%s); no longer "
                        "sending them", self.index, e)
            self._close_feed()
            self._report(error(f"shard {self.index} could not hand the draft process its "
                               f"feature rows ({e}); speculation stops", "feed_lost"))
            return False


def _prompt_lp_ok(plp: dict[str, Any], n: int, vocab: int) -> bool:
    targets, k, temp = plp.get("targets"), plp.get("k"), plp.get("temperature")
    return (isinstance(targets, list) and len(targets) <= n
            and all(isinstance(t, int) and 0 <= t < vocab for t in targets)
            and isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= vocab
            and isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp >= 0)
