"""The draft process: proposes draft tokens for the coordinator's speculative loop.

Inbound: one zmq ROUTER socket. The coordinator configures it, starts sequences and asks for
proposals; every shard that owns a tapped layer (a *feeder*) links to it once and then sends,
for every step, its tapped layers' rows (`feat`) over the edge's transport: a shared-memory or
CUDA-IPC ring polled here, or zmq frames on the ROUTER. Rows land in the proposer's
position-indexed store; a proposal first waits until every feeder has delivered the rows of the
step the coordinator names (`sync`), so no proposal reads a row that is still on its way.

A malformed frame gets an error reply and is consumed whole (zmq delivers multipart messages
whole; a ring slot is released before the error is raised), so the next message is read from
its start. A rejected feature frame also marks the sequence's context as incomplete: its
proposals are refused until the next sequence begins, never computed from a wrong context.

The draft's feature rows are part of prefix-cache entries: the same snapshot messages as a
shard's (`shards.snapshots`), over tensor `feat`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import zmq
from layersplit.draft.oracle import OracleProposer
from layersplit.draft.oracle_table import bench_oracle
from layersplit.draft.prepared import Prepared, check_next, key_of
from layersplit.draft.proposer import DFlashProposer, Proposer, load_proposer
from layersplit.ipc import transport
from layersplit.ipc.messages import PROTOCOL_VERSION, ProtocolError, error, message
from layersplit.ipc.peers import AUTH_FAILED, Gate
from layersplit.ipc.serve_loop import serve
from layersplit.ipc.sockets import bind_router, recv, ring_doorbell, send
from layersplit.ipc.step_trace import step_trace
from layersplit.ipc.transport import tensor_bytes, zmq_tensor
from layersplit.shards.device import use_device
from layersplit.shards.dtypes import torch_dtype
from layersplit.shards.kernel_profile import kernel_profile
from layersplit.shards.snapshots import SNAP_OPS, SnapshotStore, block_ms, report_saves, snap_op
from layersplit.shards.spec_tree import check_path

log = logging.getLogger("layersplit.draft")
FEATURE_WAIT_S = 30.0
PUSH_TIMEOUT_S = 0.0  # a proposal that finds the first shard's ring full goes by zmq at once:
# that shard may itself wait for this process to take feature rows (a batch of more sequences
# than ring slots sends more rows and takes more proposals than its rings hold), so waiting for
# room would hold both until a timeout
MAX_SLOTS = 1024

ALLOWED = {
    "coordinator": {"draft_configure", "draft_warm", "draft_begin", "draft_gap", "propose",
                    "draft_features", "ping", "shutdown", "wake", *SNAP_OPS},
    "feeder": {"feed", "feat", "verdict", "wake"},
}
# the messages that read or write a sequence's rows (a pending warm-up runs before them)
SLOT_OPS = frozenset({"draft_begin", "draft_gap", "propose", "draft_features", "feat",
                      "verdict", *SNAP_OPS})


@dataclasses.dataclass(frozen=True, slots=True)
class DraftSpec:
    listen: str
    draft: str
    target: str
    max_context: int
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    parent_pid: int | None = None
    seed: int = 0
    block_size: int | None = None
    graphs: bool = True
    compile: bool = True  # (a GPU DFlash draft's step through torch.compile)


@dataclasses.dataclass
class Feeder:
    """A shard that sends rows of its tapped layers."""

    layers: tuple[int, ...]
    column: int  # where its rows go in a feature row
    width: int
    route: bytes | None = None
    inbox: transport.RingInbox | None = None
    fed_sid: int = 0  # the last step whose rows arrived whole (step sids start at 1)
    proposals: transport.Sender | None = None  # to the first shard: `drafted`, through shm
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)  # slot -> why a
    # feature frame of the slot's sequence was refused


class DraftServer:
    def __init__(self, spec: DraftSpec, secret: bytes) -> None:
        self.spec = spec
        self.device = use_device(spec.device, spec.threads)
        self.router = bind_router(spec.listen, secret)
        self.gate = Gate(secret, ALLOWED, "draft")
        self.coordinator: bytes | None = None
        self.feeders: list[Feeder] = []
        self.deferred: collections.deque = collections.deque()
        self.prepared = Prepared()  # proposals computed from verdicts, before they are asked
        # per slot: the sid of its sequence's draft_begin; a frame of an older step (rows come
        # on the feeders' channels, the coordinator's messages on another, so they may come
        # after the next sequence's draft_begin) is of the sequence before and is not stored
        self.begun: dict[int, int] = {}
        self.running = True
        self.spin_s = 0.0
        self.cache_dir: str | None = None
        self.push = False  # prepared proposals go to the first shard (the first feeder)
        self.warm_pending = False  # (`_warm_when_linked`)
        self.warm_failed: str | None = None
        self.trace = step_trace("draft")  # (LAYERSPLIT_STEP_TRACE)
        self.profile = kernel_profile("draft")  # (LAYERSPLIT_KERNEL_PROFILE)
        t0 = time.perf_counter()
        oracle = bench_oracle()  # (bench/speculative.py --oracle-acceptance only)
        self.proposer: Proposer = load_proposer(
            spec.draft, spec.target, spec.device, torch_dtype(spec.dtype), spec.max_context,
            graphs=spec.graphs, block_size=spec.block_size, seed=spec.seed,
            compile=spec.compile, dflash_class=OracleProposer if oracle else DFlashProposer)
        self.oracle = oracle
        if oracle is not None:
            if not isinstance(self.proposer, OracleProposer):
                raise ValueError("the bench oracle needs a DFlash draft")
            self.proposer.set_oracle(oracle)
            log.warning("bench oracle draft: proposals replaced by %d known sequences at "
                        "acceptance %.2f", len(oracle.sequences), oracle.acceptance)
        self.snapshots: SnapshotStore | None = None
        self._new_snapshots()
        self.load_s = time.perf_counter() - t0

    def _new_snapshots(self) -> None:
        if self.snapshots is not None:
            self.snapshots.wait_pending()
        self.snapshots = (SnapshotStore({"feat": self.proposer.features})
                          if isinstance(self.proposer, DFlashProposer) else None)

    # ---- main loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        serve(lambda: self.running, self._work,
              lambda: [f.inbox for f in self.feeders if f.inbox is not None],
              lambda ms: self._poll_router(block_ms(self.snapshots, ms)), lambda: self.spin_s)

    def _work(self) -> bool:
        worked = self._warm_when_linked()
        if self._report_saves():
            worked = True
        if self._drain_inboxes():
            worked = True
        if self._prepare():
            worked = True
        if self.deferred:
            self._dispatch(*self.deferred.popleft())
            worked = True
        return self._poll_router(0) or worked

    def _poll_router(self, timeout_ms: int, feeders_only: bool = False) -> bool:
        if not self.router.poll(timeout_ms):
            return False
        while self.router.poll(0):
            route, msg, frames, err = recv(self.router, routed=True)
            assert route is not None
            if err is not None:
                self._reply(route, error(f"draft: {err}", err.code, sid=err.sid))
                self._feeder_frame_rejected(route, str(err))
                continue
            if feeders_only and self.gate.role(route) != "feeder" and \
                    msg["type"] not in ("hello", "auth"):
                self.deferred.append((route, msg, frames))  # after the wait in progress
                continue
            self._dispatch(route, msg, frames)
        return True

    def _warm_when_linked(self, now: bool = False) -> bool:
        """The warm-up `draft_configure` left pending, once every feeder has linked, so that it
        runs while the shards warm up (`now`: before a message that touches a sequence's rows,
        `SLOT_OPS`: the warm-up's own rows are a slot no sequence holds yet). A failure is kept
        for the coordinator's `draft_warm`, which fails the start with it."""
        if not self.warm_pending or not (now or all(f.route is not None for f in self.feeders)):
            return False
        self.warm_pending = False
        try:
            self.proposer.warm_up()
        except Exception as e:  # noqa: BLE001 - answered to draft_warm
            log.exception("draft: the warm-up failed")
            self.warm_failed = f"{type(e).__name__}: {e}"
        return True

    def _on_draft_warm(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """The coordinator's last word at start: answered once the warm-up is done (within the
        start's deadline, not a request's), with its failure if it failed."""
        self._warm_when_linked(now=True)
        if self.warm_failed is not None:
            raise ProtocolError(f"warm-up failed: {self.warm_failed}", "failed")
        self._reply(route, message("ok", info={}, sid=msg.get("sid")))

    def _dispatch(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        if not self.gate.screen(route, msg, self._reply):
            return
        t = msg["type"]
        if t == "auth":
            return self._on_auth(route, msg)
        if t in SLOT_OPS:
            self._warm_when_linked(now=True)
        try:
            if t in SNAP_OPS:
                if self.snapshots is None:
                    raise ProtocolError("a classic draft keeps no feature rows", "unexpected")
                if isinstance(msg.get("sync"), int):  # a snapshot of rows still on their way
                    self._wait_features(msg["sync"], msg.get("slot", 0))
                self._reply(route, message("ok", info=snap_op(self.snapshots, msg,
                                                              self.cache_dir, frames),
                                           sid=msg.get("sid")))
            elif t == "feat":
                self._on_feat(route, msg, zmq_tensor(msg, frames))
            elif t == "verdict":
                self._on_verdict(route, msg)
            elif t != "wake":
                getattr(self, f"_on_{t}")(route, msg, frames)
        except ProtocolError as e:
            self._reply(route, error(f"draft: {e}", e.code, sid=msg.get("sid")))
            if t == "feat":
                self._feeder_frame_rejected(route, str(e), msg.get("slot"))
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            log.exception("draft: %s failed", t)
            self._reply(route, error(f"draft: {t} failed: {type(e).__name__}: {e}", "failed",
                                     sid=msg.get("sid")))

    def _reply(self, route: bytes, msg: dict[str, Any], frames: list = ()) -> None:
        try:
            send(self.router, msg, frames, route=route)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY)
            log.warning("draft: cannot reply to a departed peer: %s", e)

    def _report_saves(self) -> bool:
        return report_saves(self.snapshots, self._to_coordinator)

    def _to_coordinator(self, msg: dict[str, Any], frames: list[Any] = ()) -> None:
        if self.coordinator is not None:
            self._reply(self.coordinator, msg, frames)

    # ---- authentication and setup ---------------------------------------------------------------
    def _on_auth(self, route: bytes, msg: dict[str, Any]) -> None:
        peer = self.gate.authenticate(route, msg)
        if peer is None:
            self._reply(route, error(AUTH_FAILED, "unauthenticated", sid=msg.get("sid")))
            return
        if peer.role == "coordinator":
            if self.coordinator is not None and self.coordinator != route:
                self.gate.keep_only("coordinator")
                self._close_feeders()
            self.coordinator = route
        self._reply(route, message("welcome", index=-1, layers=[], device=self.spec.device,
                                   pid=os.getpid(), host=transport.host_id()))

    def _on_draft_configure(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        if msg["max_context"] != self.spec.max_context:
            raise ProtocolError(f"draft_configure: max_context {msg['max_context']} != "
                                f"{self.spec.max_context} this draft was started with")
        if not 1 <= msg["slots"] <= MAX_SLOTS:
            raise ProtocolError(f"draft_configure: slots {msg['slots']} outside 1..{MAX_SLOTS}")
        self._close_feeders()
        self.spin_s = max(0.0, float(msg["spin_ms"])) / 1000.0
        self.cache_dir = msg["cache_dir"]
        self.push = msg["push"]
        p = self.proposer
        self.prepared.forget()
        if p.slots != msg["slots"]:  # one context per sequence of the target's batch
            p.set_slots(msg["slots"])
            self._new_snapshots()
        if isinstance(p, DFlashProposer):
            taps = list(p.cfg.target_layer_ids)
            hidden = p.cfg.model.hidden_size
            for layers in msg["feeders"]:
                if not isinstance(layers, list) or not layers or any(
                        x not in taps for x in layers):
                    raise ProtocolError(f"draft_configure: feeder layers {layers!r} are not "
                                        f"among the draft's taps {taps}")
                self.feeders.append(Feeder(tuple(layers), taps.index(layers[0]) * hidden,
                                           len(layers) * hidden))
            if self.push and not self.feeders:
                raise ProtocolError("draft_configure: push needs the first shard among the "
                                    "feeders")
            fed = sorted(x for f in self.feeders for x in f.layers)
            if fed != taps:
                raise ProtocolError(f"draft_configure: feeders cover layers {fed}, the draft "
                                    f"needs {taps}")
            # compile and capture before the first request's proposal, once every feeder has
            # linked (`_warm_when_linked`): the shards' own warm-up, after their links, runs
            # meanwhile instead of after it
            self.warm_pending, self.warm_failed = True, None
        self._reply(route, message("configured", info=self.info()))

    def info(self) -> dict[str, Any]:
        p = self.proposer
        if self.device.type == "cuda":
            mem = torch.cuda.memory_allocated(self.device)
        else:
            mem = psutil.Process().memory_info().rss
        shape = p.cfg.spec_tree if isinstance(p, DFlashProposer) else None
        out = {"kind": p.kind, "block_size": p.block_size, "device": self.spec.device,
               "tree_nodes": len(shape) if shape else 0,
               "tree_shape": [list(r) for r in shape] if shape else None,
               "dtype": self.spec.dtype, "pid": os.getpid(), "memory_bytes": int(mem),
               "load_s": round(self.load_s, 3), "protocol": PROTOCOL_VERSION,
               "taps": [], "width": 0}
        if isinstance(p, DFlashProposer):
            out.update(taps=list(p.cfg.target_layer_ids), width=p.cfg.width,
                       hidden=p.cfg.model.hidden_size)
        if self.oracle is not None:
            out["bench_oracle"] = self.oracle.acceptance
        return out

    def _on_feed(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """A feeder links: pick the edge's transport and offer it an inbox."""
        feeder = next((f for f in self.feeders if list(f.layers) == msg["layers"]), None)
        if feeder is None:
            raise ProtocolError(f"feed: layers {msg['layers']} are not a configured feeder",
                                "unexpected")
        if feeder.route is not None and feeder.route != route:
            raise ProtocolError(f"feed: the feeder of layers {msg['layers']} is linked already",
                                "unexpected")
        if msg["width"] != feeder.width or msg["dtype"] != self.spec.dtype:
            raise ProtocolError(f"feed: rows of {msg['width']} {msg['dtype']} values; this "
                                f"draft takes {feeder.width} {self.spec.dtype}")
        try:
            kind = transport.resolve(msg["transport"], msg["host"], msg["device"],
                                     self.spec.device)
        except ValueError as e:
            raise ProtocolError(str(e), "bad_transport") from e
        if feeder.inbox is not None:
            feeder.inbox.close()
        if feeder.proposals is not None:
            feeder.proposals.close()
            feeder.proposals = None
        ring = msg.get("proposals")
        if ring is not None:  # the first shard's ring for the proposals it is handed
            try:
                feeder.proposals = transport.accept(
                    "shm", ring, lambda: ring_doorbell(self.router, route))
            except (ProtocolError, ValueError, OSError, KeyError, TypeError) as e:
                raise ProtocolError(f"feed: cannot map the proposals ring: {e}",
                                    "bad_transport") from e
            feeder.proposals.timeout_s = PUSH_TIMEOUT_S
        itemsize = torch.empty((), dtype=torch_dtype(self.spec.dtype)).element_size()
        feeder.inbox, desc = transport.offer(kind, msg["max_rows"] * feeder.width * itemsize,
                                             self.device)
        feeder.route, feeder.fed_sid, feeder.rejected = route, 0, {}
        self._reply(route, message("linked", transport=kind, ring=desc))

    def _close_feeders(self) -> None:
        for f in self.feeders:
            if f.inbox is not None:
                f.inbox.close()
            if f.proposals is not None:
                f.proposals.close()
        self.feeders = []

    # ---- feature rows ----------------------------------------------------------------------------
    def _drain_inboxes(self) -> bool:
        worked = False
        for f in self.feeders:
            while f.inbox is not None and f.inbox.ready():
                worked = True
                inbox = f.inbox
                try:
                    got = inbox.poll()
                except ProtocolError as e:
                    self._refuse_feature(f, str(e))
                    continue
                if got is None:
                    break
                msg, rows, seq = got
                try:
                    if msg["type"] == "verdict":
                        self._note_verdict(msg)
                    elif msg["type"] == "feat":
                        self._store_rows(f, msg, rows)
                    else:
                        raise ProtocolError(f"ring message of type {msg['type']!r}, expected "
                                            "'feat' or 'verdict'")
                except ProtocolError as e:
                    self._refuse_feature(f, str(e), msg.get("slot"))
                finally:  # (a device slot is handed back once the copy out of it has run)
                    inbox.release(seq)
        return worked

    def _zmq_feeder(self, route: bytes, what: str) -> Feeder:
        """The feeder linked over zmq as `route` (its messages come on the router)."""
        f = next((f for f in self.feeders if f.route == route), None)
        if f is None or f.inbox is not None:
            raise ProtocolError(f"{what} from a peer that is not a zmq feeder", "unexpected")
        return f

    def _on_feat(self, route: bytes, msg: dict[str, Any], rows: torch.Tensor | None) -> None:
        self._store_rows(self._zmq_feeder(route, "feat"), msg, rows)

    def _store_rows(self, f: Feeder, msg: dict[str, Any], rows: torch.Tensor | None) -> None:
        p = self.proposer
        assert isinstance(p, DFlashProposer)
        n, pos, slot = msg["n"], msg["pos"], msg["slot"]
        if not 0 <= slot < p.slots:
            raise ProtocolError(f"feat: slot {slot} outside 0..{p.slots - 1}")
        if list(f.layers) != msg["layers"]:
            raise ProtocolError(f"feat: layers {msg['layers']}, this feeder sends "
                                f"{list(f.layers)}")
        if rows is None or tuple(rows.shape) != (n, f.width):
            got = None if rows is None else tuple(rows.shape)
            raise ProtocolError(f"feat: rows of shape {got}, expected ({n}, {f.width})")
        if not 0 <= pos or pos + n > p.max_len or n < 1:
            raise ProtocolError(f"feat: positions {pos}..{pos + n} outside the context of "
                                f"{p.max_len}")
        if msg["last"]:
            f.fed_sid = max(f.fed_sid, msg["sid"])
        if msg["sid"] < self.begun.get(slot, 0):
            return  # the sequence before's, late: its rows and verdict are of no use now
        if self.snapshots is not None and pos < self.snapshots.pending_end(slot):
            self.snapshots.wait_pending()  # a snapshot still copies the rows these replace
        p.write_features(slot, f.column, pos, rows.to(self.device, p.features.dtype))

    def _on_verdict(self, route: bytes, msg: dict[str, Any]) -> None:
        self._zmq_feeder(route, "verdict")
        self._note_verdict(msg)

    def _note_verdict(self, msg: dict[str, Any]) -> None:
        """A verify step's verdict (from the last shard, after the step's rows): the proposal
        to prepare next for the sequence, computed once every feeder's rows of that step are
        here (`_prepare`). It is a hint: a bad one is refused by name (to the coordinator) and
        the context stays whole; the proposal is then computed when asked for, or the first
        shard's held step runs without one after its wait."""
        p = self.proposer
        assert isinstance(p, DFlashProposer)
        slot, nxt = msg["slot"], msg["next"]
        try:
            if not 0 <= slot < p.slots:
                raise ValueError(f"slot {slot} outside 0..{p.slots - 1}")
            key = check_next(nxt)
        except ValueError as e:
            log.warning("draft: refused a verdict: %s", e)
            self._to_coordinator(error(f"draft: refused a verdict of step {msg['sid']}: {e}",
                                       "bad_verdict"))
            return
        if msg["sid"] < self.begun.get(slot, 0):
            return  # the sequence before's, late
        if self.trace is not None:
            self.trace("verdict", msg["sid"], slot=slot)
        self.prepared.note(slot, msg["sid"], key, self.push and nxt.get("push") is True)

    def _prepare(self) -> bool:
        """Compute the proposals verdicts named, once their steps' rows are all here: those of
        several contexts due at once (the verdicts of one batched step) in one batched step
        where the proposer batches them (`DFlashProposer.propose_batch`), else one by one."""
        due = self.prepared.due([f.fed_sid for f in self.feeders])
        if due and self.profile is not None:
            self.profile.step()  # (a step: the proposals of one verdict's contexts)
        todo = []
        for slot, sid, key, push in due:
            bad = next((f for f in self.feeders if slot in f.rejected), None)
            if bad is not None:  # an incomplete context: a request would say so
                if push:
                    self._push(slot, sid, key, None, f"the context is incomplete: a feature "
                               f"frame was refused ({bad.rejected[slot]})", 0.0)
                continue
            todo.append((slot, sid, key, push))
        p = self.proposer
        if len(todo) >= 2 and isinstance(p, DFlashProposer) and \
                all(p.batches(key[2]) for _, _, key, _ in todo):
            t0 = time.perf_counter()
            todo = [item for item in todo if self._commit(*item)]
            try:
                outs = p.propose_batch([(slot, key[1], key[0], key[2], key[3], None)
                                        for slot, _, key, _ in todo])
            except Exception as e:  # noqa: BLE001 - one by one then, each failing on its own
                log.warning("draft: cannot prepare %d proposals together (%s: %s); one by one",
                            len(todo), type(e).__name__, e)
            else:
                seconds = (time.perf_counter() - t0) / max(len(todo), 1)
                for (slot, sid, key, push), out in zip(todo, outs):
                    self._prepared(slot, sid, key, push, out, seconds)
                return True
        for slot, sid, key, push in todo:
            pos, token, n, tree, _ = key
            t0 = time.perf_counter()
            if not self._commit(slot, sid, key, push):
                continue
            try:
                out = p.propose(slot, token, pos, n, None, 0, tree)
            except Exception as e:  # noqa: BLE001 - a hint only: the request computes it
                self._not_prepared(slot, sid, key, push, e)
                continue
            self._prepared(slot, sid, key, push, out, time.perf_counter() - t0)
        return bool(due)

    def _commit(self, slot: int, sid: int, key: tuple, push: bool) -> bool:
        """Move the kept rows a verdict names into place, once (`Prepared.moved`); False
        (and the first shard told, `push`) when they cannot be."""
        pos, kept = key[0], key[4]
        if kept is None or self.prepared.moved.get(slot) == (pos, kept):
            return True
        try:
            self.proposer.commit(slot, pos, list(kept))
        except Exception as e:  # noqa: BLE001 - a hint only: the request computes it
            self._not_prepared(slot, sid, key, push, e)
            return False
        self.prepared.committed(slot, key)
        return True

    def _not_prepared(self, slot: int, sid: int, key: tuple, push: bool,
                      e: Exception) -> None:
        log.warning("draft: cannot prepare the proposal at %d of context %d: %s: %s",
                    key[0], slot, type(e).__name__, e)
        if push:
            self._push(slot, sid, key, None, f"{type(e).__name__}: {e}", 0.0)

    def _prepared(self, slot: int, sid: int, key: tuple, push: bool,
                  out: tuple[list, list | None, list | None], seconds: float) -> None:
        """A proposal computed ahead: to the first shard (`push`), or kept for the request."""
        if self.trace is not None:
            self.trace("prepared", sid, slot=slot, compute_s=seconds)
        if push:
            self._push(slot, sid, key, out, None, seconds)
        else:
            self.prepared.done(slot, key, out, seconds)

    def _push(self, slot: int, sid: int, key: tuple,
              out: tuple[list, list | None, list | None] | None,
              why: str | None, seconds: float) -> None:
        """Hand a prepared proposal (or why there is none) to the first shard, which holds
        the sequence's next step for it (`shards.asked`)."""
        first = self.feeders[0]
        if first.route is None:
            return  # not linked: the step runs without it, after its wait
        tokens, parents, q = ((None, None, None) if out is None else
                              ([int(t) for t in out[0]], out[1], out[2]))
        msg = message("drafted", feat=slot, after=sid,
                      key=[*key[:4], None if key[4] is None else list(key[4])], tokens=tokens,
                      parents=parents, q=q, error=why, compute_s=seconds)
        if first.proposals is not None:
            try:
                first.proposals.send(msg, None)
                return
            except TimeoutError:  # its ring is full: zmq then (`PUSH_TIMEOUT_S`)
                log.debug("draft: the first shard's proposals ring is full; by zmq")
        self._reply(first.route, msg)

    def _refuse_feature(self, f: Feeder, why: str, slot: int | None = None) -> None:
        """A feature frame was refused: the context of its slot's sequence (of every slot,
        when the frame is unreadable) is incomplete until that slot's next sequence begins."""
        log.warning("draft: refused a feature frame from the feeder of layers %s: %s",
                    list(f.layers), why)
        slots = [slot] if isinstance(slot, int) and 0 <= slot < self.proposer.slots else \
            range(self.proposer.slots)
        for s in slots:
            f.rejected[s] = why
        self._to_coordinator(error(f"draft: feature frame from the feeder of layers "
                                   f"{list(f.layers)} refused: {why}", "bad_feature"))

    def _feeder_frame_rejected(self, route: bytes, why: str, slot: int | None = None) -> None:
        f = next((f for f in self.feeders if f.route == route), None)
        if f is not None:
            self._refuse_feature(f, why, slot)

    def _wait_features(self, sync: int, slot: int) -> None:
        """Until every feeder has delivered the rows of step `sync` (and those before); the
        context of `slot`'s sequence must be whole."""
        deadline = time.monotonic() + FEATURE_WAIT_S
        while True:
            bad = next((f for f in self.feeders if slot in f.rejected), None)
            if bad is not None:
                raise ProtocolError(f"the context of this sequence is incomplete: a feature "
                                    f"frame of layers {list(bad.layers)} was refused "
                                    f"({bad.rejected[slot]})", "bad_feature")
            late = [f for f in self.feeders if f.fed_sid < sync]
            if not late:
                return
            if time.monotonic() > deadline:
                raise ProtocolError(f"rows of step {sync} did not arrive from the feeder of "
                                    f"layers {list(late[0].layers)} within {FEATURE_WAIT_S} s",
                                    "late_feature")
            if not self._drain_inboxes():
                self._poll_router(1 if any(f.inbox is None for f in late) else 0,
                                  feeders_only=True)

    # ---- coordinator requests --------------------------------------------------------------------
    def _on_draft_begin(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        slot = msg["slot"]
        if not 0 <= slot < self.proposer.slots:
            raise ProtocolError(f"draft_begin: slot {slot} outside 0..{self.proposer.slots - 1}")
        sample = msg["sample"]
        if sample is not None:
            why = _check_draft_sample(sample)
            if why is not None:
                raise ProtocolError(f"draft_begin: sample {str(sample)[:200]}: {why}")
        self.proposer.begin(slot, sample)
        self.prepared.forget(slot)
        self.begun[slot] = msg["sid"]
        for f in self.feeders:
            f.rejected.pop(slot, None)
        self._reply(route, message("ok", info={}, sid=msg["sid"]))

    def _on_draft_gap(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        p = self.proposer
        if not isinstance(p, DFlashProposer):
            raise ProtocolError("a classic draft keeps no feature rows", "unexpected")
        try:
            p.gap(msg["slot"], msg["start"], msg["end"])
        except ValueError as e:
            raise ProtocolError(f"draft_gap: {e}") from e
        self.prepared.forget(msg["slot"])
        self._reply(route, message("ok", info={}, sid=msg["sid"]))

    def _on_propose(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        tokens = None
        if frames:
            if len(frames) != 1:
                raise ProtocolError(f"propose: expected at most 1 payload frame, got "
                                    f"{len(frames)}")
            tokens = transport.tensor_from(frames[0].buffer, {
                "dtype": "int64", "shape": [len(frames[0].buffer) // 8]})
        if isinstance(self.proposer, DFlashProposer):
            self._wait_features(msg["sync"], msg["slot"])
        kept = msg["kept"]
        if kept is not None:
            try:
                check_path(kept, msg["pos"])
            except ValueError as e:
                raise ProtocolError(f"propose: {e}") from e
        if msg["tree"] < 0:
            raise ProtocolError(f"propose: tree {msg['tree']} is negative")
        ready, move = self.prepared.take(msg["slot"], key_of(msg["pos"], msg["token"], msg["n"],
                                                             msg["tree"], kept), msg["sync"])
        if ready is not None:
            (out, parents, q), seconds = ready
            verdict_at, ready_at = self.prepared.times.get(msg["slot"], (0.0, 0.0))
            self._reply(route, message("proposal", sid=msg["sid"], tokens=[int(t) for t in out],
                                       parents=parents, q=q, compute_s=seconds, prepared=True,
                                       verdict_at=verdict_at, ready_at=ready_at,
                                       asked_at=time.monotonic()))
            return
        t0 = time.perf_counter()
        try:
            out, parents, q = self.proposer.propose(msg["slot"], msg["token"], msg["pos"],
                                                    msg["n"], tokens, msg["start"], msg["tree"],
                                                    kept if move else None)
        except ValueError as e:
            raise ProtocolError(str(e)) from e
        self._reply(route, message("proposal", sid=msg["sid"], tokens=[int(t) for t in out],
                                   parents=parents, q=q, compute_s=time.perf_counter() - t0))

    def _on_draft_features(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """The stored feature rows [start, end) (for inspection and tests)."""
        p = self.proposer
        if not isinstance(p, DFlashProposer):
            raise ProtocolError("a classic draft keeps no feature rows", "unexpected")
        a, b, slot = msg["start"], msg["end"], msg["slot"]
        if not 0 <= a < b <= p.max_len or not 0 <= slot < p.slots:
            raise ProtocolError(f"draft_features: rows {a}:{b} of slot {slot} outside "
                                f"0..{p.max_len} of 0..{p.slots - 1}")
        self._wait_features(msg["sync"], slot)  # the rows of that step may still be on their way
        rows = p.features[0, slot, a:b].float().cpu().contiguous()
        self._reply(route, message("features", sid=msg["sid"], act={
            "dtype": "float32", "shape": list(rows.shape)}), [tensor_bytes(rows)])

    def _on_ping(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("pong", busy=False))

    def _on_shutdown(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("bye"))
        self.running = False

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.profile is not None:
            self.profile.close()
        if self.snapshots is not None:
            self.snapshots.wait_pending()
        self._close_feeders()
        if not self.router.closed:
            self.router.close(0)


def run_draft(spec: DraftSpec, secret: bytes, error_file: str | None = None) -> int:
    """Entry point of the draft process. Exit codes: 0 clean, 2 startup error, 3 orphaned.
    A startup error's text goes to `error_file` too, for the coordinator to report."""
    import signal

    from layersplit.ipc.parent_watch import watch_parent
    from layersplit.shards.worker import _exit_on_signal

    server: DraftServer | None = None

    def cleanup() -> None:
        if server is not None:
            for f in server.feeders:
                ring = getattr(f.inbox, "ring", None)
                if ring is not None:
                    ring.unlink()

    if spec.parent_pid:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch_parent(spec.parent_pid, cleanup, role="draft")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server = DraftServer(spec, secret)
    except Exception as e:  # noqa: BLE001 - reported through the exit code and the log
        log.error("draft %s on %s failed to start: %s", spec.draft, spec.device, e)
        if error_file:
            Path(error_file).write_text(f"{type(e).__name__}: {e}")
        return 2
    log.info("draft (%s) on %s listening on %s", server.proposer.kind, spec.device, spec.listen)
    try:
        server.serve_forever()
    finally:
        cleanup()
        server.close()
    return 0


def _check_draft_sample(sample: dict) -> str | None:
    """What is wrong with a `draft_begin`'s sampling parameters, or None."""
    t, k, p, seed = (sample.get(f) for f in ("temperature", "top_k", "top_p", "seed"))
    num = (int, float)
    if not isinstance(t, num) or isinstance(t, bool) or not t > 0:
        return "temperature must be a number > 0 (greedy sequences send none)"
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        return "top_k must be an integer >= 0"
    if not isinstance(p, num) or isinstance(p, bool) or not 0 < p <= 1:
        return "top_p must be in (0, 1]"
    if not isinstance(seed, int) or isinstance(seed, bool):
        return "seed must be an integer"
    if sample.get("mode") not in ("coupled", "rejection"):
        return "mode must be coupled or rejection"
    return None
