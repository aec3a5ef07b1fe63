"""A shard process: owns layers [start, end) and their KV cache.

Inbound: one zmq ROUTER socket for control (from the coordinator), link setup and zmq-transport
steps (from the upstream shard); and, on one host, a shared-memory ring (`ipc.transport.RingInbox`)
that carries the steps themselves. Every zmq peer must first prove it holds the shared secret
(`ipc.auth`). Outbound: the step's output goes to the downstream shard over the edge's transport;
the last shard sends the sampled token (and logits when asked) to the coordinator.

The loop spins on its inbox for `spin_ms` after the last message (no wake-up latency on the
decode path), then sleeps on the ROUTER socket until a doorbell or a control message arrives.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

import psutil
import torch
import zmq
from layersplit.ipc import transport
from layersplit.ipc.messages import PROTOCOL_VERSION, ProtocolError, error, message
from layersplit.ipc.peers import AUTH_FAILED, Gate, expect, handshake
from layersplit.ipc.serve_loop import serve
from layersplit.ipc.sockets import (
    bind_router,
    connect_dealer,
    context,
    recv,
    request,
    ring_doorbell,
    send,
)
from layersplit.ipc.step_trace import step_trace
from layersplit.ipc.token_board import TokenBoard
from layersplit.ipc.transport import ZmqSender, tensor_from, zmq_tensor
from layersplit.shards.asked import DRAFT_WAIT_S, asked, check_drafted, fill, ready
from layersplit.shards.busy_clock import BusyClock
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.decode_ahead import UnsentResults, deferrable
from layersplit.shards.device import use_device
from layersplit.shards.dtypes import torch_dtype
from layersplit.shards.early_moves import EarlyMoves
from layersplit.shards.executor import MAX_VERIFY_ROWS, RangeExecutor, Segment
from layersplit.shards.fused import fuse_projections, warm_prefill
from layersplit.shards.host_kv import HostKVPool
from layersplit.shards.hybrid_cache import HybridState
from layersplit.shards.kernel_profile import kernel_profile
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.sampling import (
    SamplingParams,
    accept_draft,
    check_mask,
    check_processors,
    has_processors,
    is_greedy,
    logprob_entries,
    process_logits,
    sample_rows,
    sample_tokens,
)
from layersplit.shards.snapshots import SNAP_OPS, SnapshotStore, report_saves, snap_op
from layersplit.shards.spec_sampling import check_q, check_q_form
from layersplit.shards.spec_tree import check_path, check_tree, rows_to_move

log = logging.getLogger("layersplit.shard")
LINK_TIMEOUT_S = 60.0
FEED_TIMEOUT_S = 2.0  # a draft that takes no rows for this long is dropped, the step goes on
FEED_ROWS = 1024  # rows per feature message (a long prefill chunk is sent in pieces)
PROPOSAL_BYTES = 64  # a `drafted` message is all header: its ring slots need no payload
MAX_SLOTS = 1024  # sequences a shard's KV cache may hold
MASK_WAIT_S = 10.0  # the last shard waits this long for a step's late grammar masks, then fails it
# the first shard holds a lookahead step this long for the tokens of the step it follows (a step
# that fails on its way is voided by the coordinator at once: this bounds a lost message)
AHEAD_WAIT_S = 60.0
AHEAD_POLL_S = 1e-3  # a CPU shard's sleep between looks at the board while it holds a step
MAX_BLOCK_TOKENS = 4096  # rows of one KV block


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSpec:
    listen: str
    model: str
    start: int
    end: int
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    parent_pid: int | None = None
    seed: int = 0
    heartbeat_s: float | None = None  # zmq heartbeats on our sockets (a shard started by hand
    # on another host); None for a shard the coordinator started here: it watches the process


ALLOWED = {"coordinator": {"configure", "ping", "shutdown", "step", "sample", "mask", "wake",
                           "draft_gone", "kv_swap", "warm", "void", *SNAP_OPS},
           "upstream": {"link", "step", "wake"}}


class ShardServer:
    def __init__(self, spec: ShardSpec, secret: bytes) -> None:
        self.spec, self.secret = spec, secret
        self.device = use_device(spec.device, spec.threads)
        self.ctx = context()
        self.router = bind_router(spec.listen, secret, spec.heartbeat_s)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.gate = Gate(secret, ALLOWED, f"shard {spec.start}:{spec.end}")
        self.coordinator: bytes | None = None
        self.upstream: bytes | None = None
        self.down: zmq.Socket | None = None
        self.out: transport.Sender | None = None  # downstream edge, or results (last shard)
        self.inbox: transport.RingInbox | None = None  # steps, when they come through a ring
        self.taps: tuple[int, ...] = ()  # global layers whose rows feed the draft process
        self.feed_sock: zmq.Socket | None = None
        self.feed: transport.Sender | None = None  # feature rows to the draft process
        self.feed_kind = "none"  # its transport
        self.executor: RangeExecutor | None = None
        self.index = -1
        self.running = True
        self.busy = False
        self.clock = BusyClock(self.device)  # seconds the device spent on steps
        self.trace = step_trace(f"shard-{spec.start}-{spec.end}")  # (LAYERSPLIT_STEP_TRACE)
        self.profile = kernel_profile(f"shard-{spec.start}-{spec.end}")  # (its kernels)
        self.spin_s = 0.0
        self.transport_kind = "none"
        self.max_step = 0
        self.fused = False
        self.snapshots: SnapshotStore | None = None
        self.host_kv: HostKVPool | None = None  # the host tier of live KV (`_on_kv_swap`)
        self.cache_dir: str | None = None
        # the first shard: a step held for the draft's proposals (`shards.asked`), the steps
        # that came after it (run in order once it runs), the last proposal per draft context
        self.held: tuple[dict[str, Any], torch.Tensor, float] | None = None
        self.queued: collections.deque = collections.deque()
        self.drafted: dict[int, dict[str, Any]] = {}
        self.proposals: transport.RingInbox | None = None  # the draft's `drafted`, on one host
        self.draft_gone: str | None = None  # why no proposal will come any more
        # malformed proposals, by draft context (None: unreadable, any context's): the next
        # held step of that context runs without one, saying why
        self.bad_drafted: dict[int | None, str] = {}
        # the last shard: grammar masks sent after their steps, by (sid, segment), and the step
        # whose sampling waits for some (its logits, since when); steps after it queue
        self.late_masks: dict[tuple[int, int], bytes | None] = {}
        self.awaiting: tuple[dict[str, Any], list[torch.Tensor], list, float] | None = None
        # the last shard: the kept tree rows it moved as soon as it sampled their verify step
        self.early = EarlyMoves()
        # decode lookahead (`shards.decode_ahead`): each slot's last sampled token, which the
        # last shard posts and the first takes (`ipc.token_board`: the first and last shards
        # only); results still waiting for their tokens to reach the host
        self.board: TokenBoard | None = None
        self.unsent = UnsentResults()
        t0 = time.perf_counter()
        ckpt = open_checkpoint(spec.model, spec.seed)
        self.cfg = ckpt.config
        self.model = load_layer_range(ckpt, spec.start, spec.end, torch_dtype(spec.dtype),
                                      self.device)
        self.load_s = time.perf_counter() - t0

    # ---- main loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        serve(lambda: self.running, self._work,
              lambda: [r for r in (self.inbox, self.proposals) if r is not None],
              self._poll_sockets, lambda: self.spin_s)

    def _work(self) -> bool:
        # (results whose tokens are on the host go before the next step is taken)
        worked = self.unsent.flush(wait=False) | self._report_saves()
        if self.held is not None:
            if self._run_held():
                worked = True
            elif not asked(self.held[0]):  # (spins: the last shard posts within its step)
                worked = True
                if self.device.type == "cpu":
                    time.sleep(AHEAD_POLL_S)  # (the cores compute the last shard's step)
        if self.awaiting is not None and time.monotonic() - self.awaiting[3] > MASK_WAIT_S:
            msg = self.awaiting[0]
            self.awaiting = None
            self._step_failed(msg, TimeoutError(
                f"step {msg['sid']}: its grammar masks did not come within {MASK_WAIT_S:.0f} s"))
            self._run_queued()
            worked = True
        if self.proposals is not None and self.proposals.ready():
            self._take_proposals()
            worked = True
        if self.inbox is not None and self.inbox.ready():
            self._handle_inbox()
            worked = True
        if self.unsent:  # (spins until the device has their tokens)
            self.unsent.flush(wait=False)
            worked = True
        return self._poll_sockets(0) or worked

    def _report_saves(self) -> bool:
        """Tell the coordinator about disk writes the background threads finished."""
        return report_saves(self.snapshots, self._to_coordinator)

    def _to_coordinator(self, msg: dict[str, Any], frames: list[Any] = ()) -> None:
        if self.coordinator is not None:
            self._reply(self.coordinator, msg, frames)

    def _poll_sockets(self, timeout_ms: int) -> bool:
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            if sock is self.router:
                self._handle_router()
            elif sock is self.down:
                self._handle_downstream_reply()
            else:
                self._handle_draft_reply(sock)
        return bool(events)

    def _handle_inbox(self) -> None:
        assert self.inbox is not None
        try:
            got = self.inbox.poll()
        except ProtocolError as e:
            self._report(error(f"shard {self.index}: bad message in its inbound ring: {e}",
                               e.code, sid=None))
            return
        if got is None:
            return
        msg, x, seq = got
        inbox = self.inbox
        try:
            if msg["type"] != "step":
                raise ProtocolError(f"ring message of type {msg['type']!r}, expected 'step'")
            if self.trace is not None:
                self.trace("recv", msg["sid"])
            self._step(msg, x)
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            self._step_failed(msg, e)
        finally:  # (a device slot is handed back once the kernels reading it have run)
            inbox.release(seq)

    def _handle_router(self) -> None:
        route, msg, frames, err = recv(self.router, routed=True)
        assert route is not None
        if err is not None:
            self._reply(route, error(f"shard {self.index}: {err}", err.code, sid=err.sid))
            self._note_bad_upstream(route, err.sid)
            return
        if not self.gate.screen(route, msg, self._reply):
            return
        t = msg["type"]
        if t == "auth":
            return self._on_auth(route, msg)
        try:
            if t == "step":
                expected = self.coordinator if self.model.is_first else self.upstream
                if route != expected or self.inbox is not None:
                    raise ProtocolError("step from a peer that does not feed this shard",
                                        "unexpected")
                if self.trace is not None:
                    self.trace("recv", msg["sid"])
                self._step(msg, zmq_tensor(msg, frames))
            elif t in SNAP_OPS:
                store = self._snap_store()
                self._snap_blocks(msg)
                self._reply(route, message("ok", info=snap_op(store, msg, self.cache_dir,
                                                              frames),
                                           sid=msg.get("sid")))
            elif t != "wake":
                getattr(self, f"_on_{t}")(route, msg, frames)
        except ProtocolError as e:
            self.unsent.flush(wait=True)  # (the results of the steps before it go first)
            self._reply(route, error(f"shard {self.index}: {e}", e.code, sid=msg.get("sid")))
            self._note_bad_upstream(route, msg.get("sid"))
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            self._step_failed(msg, e, route)

    def _step_failed(self, msg: dict[str, Any], e: Exception, route: bytes | None = None) -> None:
        self.unsent.flush(wait=True)  # (the results of the steps before it go first)
        if self.board is not None and self.model.is_last and msg.get("type") == "step" and \
                isinstance(msg.get("sid"), int):  # (other messages overtake steps: not theirs)
            self.board.passed(msg["sid"])  # (no token of it will come)
        self._report(self._failure(msg, e), route)

    def _failure(self, msg: dict[str, Any], e: Exception) -> dict[str, Any]:
        """The error message that reports `msg`'s failure with `e`."""
        if isinstance(e, ProtocolError):
            return error(f"shard {self.index}: {e}", e.code, sid=msg.get("sid"))
        log.exception("shard %d: %s failed", self.index, msg.get("type"))
        return error(f"shard {self.index} ({self.spec.start}:{self.spec.end}): "
                     f"{msg.get('type')} failed: {type(e).__name__}: {e}", "failed",
                     sid=msg.get("sid"))

    def _note_bad_upstream(self, route: bytes, sid: int | None) -> None:
        """A message the linked upstream shard sent was rejected: the coordinator's step fails."""
        if route == self.upstream and self.upstream is not None and self.coordinator is not None:
            self._reply(self.coordinator, error(
                f"shard {self.index}: rejected a malformed message from its upstream shard",
                "bad_upstream", sid=sid))

    def _handle_downstream_reply(self) -> None:
        """Errors the downstream shard sends back to us go to the coordinator."""
        assert self.down is not None
        _, msg, _, err = recv(self.down)
        if err is not None:
            msg = error(f"shard {self.index}: malformed reply from downstream: {err}", err.code)
        if self.coordinator is not None and msg["type"] != "wake":
            self._reply(self.coordinator, msg)

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

    def _reply(self, route: bytes, msg: dict[str, Any], frames: list = ()) -> None:
        try:
            send(self.router, msg, frames, route=route)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY): nothing to tell it
            log.warning("shard %d: cannot reply to a departed peer: %s", self.index, e)

    def _report(self, msg: dict[str, Any], route: bytes | None = None) -> None:
        """Errors go to the coordinator, and to the peer that caused them if that is another."""
        if self.coordinator is not None:
            self._reply(self.coordinator, msg)
        if route is not None and route != self.coordinator:
            self._reply(route, msg)

    # ---- authentication ---------------------------------------------------------------------
    def _on_auth(self, route: bytes, msg: dict[str, Any]) -> None:
        peer = self.gate.authenticate(route, msg)
        if peer is None:
            self._reply(route, error(AUTH_FAILED, "unauthenticated", sid=msg.get("sid")))
            return
        if peer.role == "coordinator":
            if self.coordinator is not None and self.coordinator != route:
                self._reset_session()
            self.coordinator = route
        self._reply(route, message("welcome", index=self.index,
                                   layers=[self.spec.start, self.spec.end],
                                   device=self.spec.device, pid=os.getpid(),
                                   host=transport.host_id()))

    def _reset_session(self) -> None:
        """A new coordinator took over (remote shards outlive coordinators): its predecessor's
        links, snapshots and swapped-out blocks are gone with it (the new one's ledger of this
        shard's host memory starts at zero)."""
        self.gate.keep_only("coordinator")
        self.unsent.clear()  # (results of the old session's steps)
        self.held, self.awaiting = None, None  # (steps of the old session, held or waiting)
        self.queued.clear()
        self.early.clear()
        self._close_links()
        if self.snapshots is not None:
            self.snapshots.wait_pending()
            self.snapshots.entries.clear()
        if self.host_kv is not None:
            self.host_kv.drop(list(self.host_kv.held))

    # ---- setup ------------------------------------------------------------------------------
    def _on_configure(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self.index = int(msg.get("index", self.index))
        self.late_masks.clear()
        self.awaiting = None
        self._close_links()
        self.held, self.drafted, self.draft_gone, self.bad_drafted = None, {}, None, {}
        self.queued.clear()
        self.early.clear()
        self.unsent.clear()  # (a new configuration: results of the steps before it are void)
        max_ctx, max_step = msg["max_context"], msg["max_step_tokens"]
        slots, block, blocks = msg["slots"], msg["kv_block"], msg["kv_blocks"]
        if max_ctx <= 0 or max_step <= 0 or not 1 <= slots <= MAX_SLOTS:
            raise ProtocolError(f"configure: max_context and max_step_tokens must be > 0, slots "
                                f"1..{MAX_SLOTS}")
        if not 1 <= block <= MAX_BLOCK_TOKENS or blocks < 1:
            raise ProtocolError(f"configure: kv_block={block} must be 1..{MAX_BLOCK_TOKENS} and "
                                f"kv_blocks={blocks} at least 1")
        graphs = bool(msg.get("cuda_graphs", True)) and self.device.type == "cuda"
        taps = msg.get("taps") or []
        if not isinstance(taps, list) or not all(
                isinstance(t, int) and self.spec.start <= t < self.spec.end for t in taps):
            raise ProtocolError(f"configure: taps {taps!r} must be layers of "
                                f"{self.spec.start}:{self.spec.end}")
        if self.device.type == "cuda" and not self.fused:
            fuse_projections(self.model, compile=bool(msg.get("torch_compile", True)))
            self.fused = True
        bucket = int(msg.get("graph_bucket", 256))
        self.spin_s = max(0.0, float(msg.get("spin_ms", 0.0))) / 1000.0
        ex = self.executor
        if ex is None or ex.max_len != max_ctx or ex.kv.slots != slots or \
                ex.paged != (blocks, block) or \
                (ex.static is not None) != graphs or \
                (ex.static is not None and ex.static.bucket != bucket) or ex.taps != tuple(taps):
            self.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.executor = RangeExecutor(self.model, max_ctx, slots, self.device,
                                          static_decode=graphs, graph_bucket=bucket,
                                          taps=tuple(taps), paged=(blocks, block))
            kv = self.executor.kv
            whole, forget = None, None
            if isinstance(kv, HybridState):
                whole, forget = {"conv": kv.conv, "state": kv.state}, kv.forget
            log.info("shard %d: KV pool of %d blocks of %d tokens (%.0f MB)", self.index, blocks,
                     block, kv.nbytes / 2**20)
            self.snapshots = SnapshotStore(kv.snapshot_rows(), max_ctx, whole, forget)
        self.executor.deterministic = bool(msg.get("deterministic", False))
        host_blocks = msg.get("kv_host_blocks", 0)
        if not isinstance(host_blocks, int) or isinstance(host_blocks, bool) or host_blocks < 0:
            raise ProtocolError(f"configure: kv_host_blocks={host_blocks!r} must be an int >= 0")
        kv = self.executor.kv
        if self.host_kv is None or self.host_kv.num_blocks != host_blocks or \
                self.host_kv.kv is not kv:
            if self.host_kv is not None:
                self.host_kv.close()  # (its page-locked buffers given back)
            self.host_kv = None
            if host_blocks:
                self.host_kv = HostKVPool(kv, host_blocks)
                log.info("shard %d: host KV pool of up to %d blocks (%.0f MB, taken as "
                         "sequences are swapped out)", self.index, host_blocks,
                         host_blocks * self.host_kv.block_bytes / 2**20)
        self.taps = tuple(taps)
        info_extra: dict[str, Any] = {}
        if self.model.is_first and self.model.is_last:
            self.board = TokenBoard.local(slots, self.device)
        elif self.model.is_last and msg.get("board") is True:  # lookahead on a split runtime
            self.board, info_extra["board"] = TokenBoard.create(slots, self.device)
        elif self.model.is_first and msg.get("board") is not None:  # the last shard's board
            self.board = TokenBoard.attach(msg["board"], slots, self.device)
            info_extra["board"] = self.board is not None
        self.cache_dir = msg.get("cache_dir")
        self.max_step = max_step
        if self.model.is_first and msg.get("inbox"):  # the coordinator shares this host
            # token ids stay on the host until checked (`_segments`)
            self.inbox, desc = transport.offer("shm", max_step * 8, torch.device("cpu"))
            info_extra["inbox"] = desc
        if self.taps and msg.get("draft") is not None:
            self._link_draft(msg["draft"], msg["session"])
        nxt = msg["next"]
        if nxt is not None:
            self._link_downstream(nxt, msg["session"], msg["transport"])
        elif self.model.is_last:
            results = msg.get("results")
            if results is not None:  # the coordinator's result ring
                coordinator = self.coordinator
                doorbell = lambda: ring_doorbell(self.router, coordinator)
                self.out = transport.accept("shm", results, doorbell)
            else:
                self.out = ZmqSender(self.router, route)
        self._reply(route, message("configured", info={**self.info(), **info_extra}))

    def _dealer(self, address: Any, session: bytes, what: str) -> zmq.Socket:
        """A DEALER socket connected and authenticated to another server of this run."""
        if not isinstance(address, str):
            raise ProtocolError(f"configure: {what} address must be a string")
        ident = f"shard{self.index}-{what}-".encode() + session[:8] + os.urandom(4)
        sock = connect_dealer(self.ctx, address, self.secret, identity=ident,
                              heartbeat_s=self.spec.heartbeat_s)
        try:
            handshake(sock, self.secret, "upstream" if what == "next" else "feeder",
                      LINK_TIMEOUT_S, f"the {what} process")
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _link_downstream(self, nxt: dict[str, Any], session: bytes, requested: str) -> None:
        self.down = down = self._dealer(nxt.get("address"), session, "next")
        reply, _ = request(down, message(
            "link", transport=requested, host=transport.host_id(), device=self.spec.device,
            dtype=self.spec.dtype, hidden=self.cfg.hidden_size, max_step_tokens=self.max_step,
        ), LINK_TIMEOUT_S)
        expect(reply, "linked", "the downstream shard")
        self.out = transport.accept(reply["transport"], reply["ring"],
                                    lambda: ring_doorbell(down), sock=down)
        self.transport_kind = reply["transport"]
        self.poller.register(down, zmq.POLLIN)

    def _link_draft(self, desc: Any, session: bytes) -> None:
        """Feature rows of this shard's tapped layers go to the draft process."""
        if not isinstance(desc, dict):
            raise ProtocolError("configure: draft must be a map")
        self.feed_sock = sock = self._dealer(desc.get("address"), session, "draft")
        width = len(self.taps) * self.cfg.hidden_size
        ring = None
        if self.model.is_first:  # proposals the draft hands this shard come through shm
            self.proposals, ring = transport.offer("shm", PROPOSAL_BYTES, torch.device("cpu"))
        reply, _ = request(sock, message(
            "feed", transport=str(desc.get("transport", "auto")), host=transport.host_id(),
            device=self.spec.device, dtype=self.spec.dtype, layers=list(self.taps), width=width,
            max_rows=min(self.max_step, FEED_ROWS), proposals=ring), LINK_TIMEOUT_S)
        expect(reply, "linked", "the draft process")
        sock.setsockopt(zmq.SNDTIMEO, int(FEED_TIMEOUT_S * 1000))
        self.feed_kind = reply["transport"]
        self.feed = transport.accept(reply["transport"], reply["ring"],
                                     lambda: ring_doorbell(sock), sock=sock)
        if isinstance(self.feed, transport.RingSender):
            self.feed.timeout_s = FEED_TIMEOUT_S
        self.poller.register(sock, zmq.POLLIN)

    def _on_link(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        try:
            kind = transport.resolve(msg["transport"], msg["host"], msg["device"], self.spec.device)
        except ValueError as e:
            raise ProtocolError(str(e), "bad_transport") from e
        if msg["hidden"] != self.cfg.hidden_size:
            raise ProtocolError(f"link: hidden size {msg['hidden']} != {self.cfg.hidden_size}")
        if msg["dtype"] not in transport.DTYPES:
            raise ProtocolError(f"link: unknown dtype {msg['dtype']!r}")
        itemsize = torch.empty((), dtype=transport.DTYPES[msg["dtype"]]).element_size()
        payload = msg["max_step_tokens"] * msg["hidden"] * itemsize
        if self.inbox is not None:
            self.inbox.close()
        self.inbox, desc = transport.offer(kind, payload, self.device)
        self.upstream = route  # the peer that linked is the one whose steps we take
        self._reply(route, message("linked", transport=kind, ring=desc))

    def info(self) -> dict[str, Any]:
        ex = self.executor
        if self.device.type == "cuda":
            mem = torch.cuda.memory_allocated(self.device)
        else:
            mem = psutil.Process().memory_info().rss
        return {
            "index": self.index, "layers": [self.spec.start, self.spec.end],
            "device": self.spec.device, "dtype": self.spec.dtype, "pid": os.getpid(),
            "memory_bytes": int(mem), "load_s": round(self.load_s, 3),
            "kv_capacity_tokens": ex.kv.num_blocks * ex.kv.block if ex else 0,
            "kv_blocks": ex.kv.num_blocks if ex else 0, "kv_block": ex.kv.block if ex else 0,
            "slots": ex.kv.slots if ex else 0,
            "deterministic": bool(ex and ex.deterministic),
            "kv_bytes": ex.kv.nbytes if ex else 0,
            "kv_host_blocks": self.host_kv.num_blocks if self.host_kv else 0,
            "kv_host_bytes": self.host_kv.nbytes if self.host_kv else 0,
            "kv_layout": self._kv_layout(),
            "transport_out": self.transport_kind, "transport_feed": self.feed_kind,
            "protocol": PROTOCOL_VERSION,
        }

    def _kv_layout(self) -> dict[str, Any]:
        """What this shard's prefix-cache tensors are: K/V rows of `layers` layers, and on a
        hybrid model which global layers those are (`attn_layers`) and the state of its
        linear-attention layers (`linear_layers`: conv and recurrent state shapes)."""
        lay: dict[str, Any] = {"layers": self.spec.end - self.spec.start,
                               "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim,
                               "dtype": self.spec.dtype}
        model = self.model
        if getattr(model, "spec", None) is not None:  # a hybrid range
            sp = model.spec
            lay.update(layers=len(model.attn_layers), attn_layers=list(model.attn_layers),
                       linear_layers=list(model.linear_layers),
                       conv_shape=[sp.conv_dim, sp.conv_kernel - 1],
                       state_shape=[sp.num_value_heads, sp.key_head_dim, sp.value_head_dim],
                       state_dtype="float32")
        return lay

    # ---- data plane -------------------------------------------------------------------------
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
        until they come (`shards.asked`), and the steps after it wait behind it."""
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
            self.out.send(message("step", sid=msg["sid"], seqs=msg["seqs"], act=None),
                          outs[0] if len(outs) == 1 else torch.cat(outs))
        # (on the last shard, before the verdict: the draft takes them while it is made)
        for j, (_, s) in enumerate(fed):
            self._send_features(msg["sid"], s.feed, s.pos, s.n, s.taps, j == len(fed) - 1)
        if not self.model.is_last:
            return
        sid = msg["sid"]
        late = [i for i, seg in enumerate(msg["seqs"])
                if seg["sample"] is not None and seg["sample"].get("late_mask")]
        if any((sid, i) not in self.late_masks for i in late):
            self.awaiting = (msg, outs, fed, time.monotonic())  # `_on_mask` goes on
            return
        self._sample_step(msg, outs, fed)

    def _on_mask(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """A grammar mask computed while its step ran: the step samples once it has all."""
        if not self.model.is_last:
            raise ProtocolError("mask: only the last shard samples", "unexpected")
        if msg["mask"] is not None:
            bad = check_mask(msg["mask"], self.cfg.vocab_size, "mask")
            if bad is not None:
                raise ProtocolError(f"mask of step {msg['sid']}: {bad}")
        self.late_masks[(msg["sid"], msg["seg"])] = msg["mask"]
        if self.awaiting is None or self.awaiting[0]["sid"] != msg["sid"]:
            return
        step, outs, fed, _ = self.awaiting
        if all((step["sid"], i) in self.late_masks for i, seg in enumerate(step["seqs"])
               if seg["sample"] is not None and seg["sample"].get("late_mask")):
            self.awaiting = None
            try:
                self._sample_step(step, outs, fed)
            except Exception as e:  # noqa: BLE001 - reported, the loop goes on
                self._step_failed(step, e)
            self._run_queued()

    def _sample_step(self, msg: dict[str, Any], outs: list[torch.Tensor],
                     fed: list[tuple[int, Segment]]) -> None:
        """The last shard's sampling of a step whose rows ran (`outs`, a tensor per segment;
        `fed`: the segments that feed the draft), its late masks in hand; the result goes to
        the coordinator, the verdicts to the draft."""
        sid = msg["sid"]
        seqs = []
        for i, seg in enumerate(msg["seqs"]):
            if seg["sample"] is not None and seg["sample"].get("late_mask"):
                sample = {k: v for k, v in seg["sample"].items() if k != "late_mask"}
                sample["mask"] = self.late_masks.pop((sid, i))
                seg = {**seg, "sample": sample}
            seqs.append(seg)
        msg = {**msg, "seqs": seqs}
        for key in [k for k in self.late_masks if k[0] <= sid]:  # (of steps that failed)
            del self.late_masks[key]
        if deferrable(msg["seqs"], bool(fed)):
            self._sample_on_device(msg, outs)
            return
        self.unsent.flush(wait=True)  # (results go in step order)
        results, logits_rows = [], []
        greedy = {}  # plain greedy segments: one argmax for all (one device sync)
        plain = [i for i, seg in enumerate(msg["seqs"]) if seg["draft"] is None and
                 seg["sample"] is not None and is_greedy(seg["sample"]["temperature"],
                                                         seg["sample"]["top_k"])
                 and seg["sample"].get("lp") is None and not has_processors(seg["sample"])]
        if len(plain) > 1:
            rows = torch.stack([outs[i][-1] for i in plain]).argmax(dim=-1).tolist()
            greedy = dict(zip(plain, rows))
        for i, (seg, out) in enumerate(zip(msg["seqs"], outs)):
            logits = out[-1]
            token, accepted, path, lp = None, 0, None, None
            if i in greedy:
                token = greedy[i]
            elif seg["sample"] is not None:
                token, accepted, path, logits, lp = _sample_segment(seg, out)
            plp = seg["plp"]
            if plp is not None:
                plp = logprob_entries(out[:len(plp["targets"])], plp["targets"],
                                      float(plp["temperature"]), plp["k"])
            results.append({"token": token, "accepted": accepted, "logits": seg["logits"],
                            "path": path, "asked": seg["asked"], "lp": lp, "plp": plp})
            if seg["logits"]:
                logits_rows.append(logits.float()[None])
        # with the verdict, the draft prepares its next proposal (it has the rows already);
        # when it hands that to the first shard, the coordinator is off the decode path, and
        # the verdict goes first
        pushed = any(seg["then"] is not None and seg["then"].get("push") is True
                     for seg in msg["seqs"])
        result = (message("result", sid=msg["sid"], outs=results, act=None),
                  torch.cat(logits_rows).cpu() if logits_rows else None)
        if self.trace is not None:
            self.trace("sampled", msg["sid"])
            if not pushed:
                self.trace("sent", msg["sid"])
        if not pushed:
            self.out.send(*result)
        for i, s in fed:
            nxt = _next_proposal(msg["seqs"][i], results[i])
            if nxt is not None and self.feed is not None:
                self._to_draft(message("verdict", sid=msg["sid"], slot=s.feed, next=nxt))
        if pushed:
            if self.trace is not None:
                self.trace("sent", msg["sid"])
            self.out.send(*result)
        self.early.after_sampling(self.executor, msg["seqs"], results,  # `shards.early_moves`
                                  f"shard {self.index}")

    def _sample_on_device(self, msg: dict[str, Any], outs: list[torch.Tensor]) -> None:
        """Sample a step of plain decode segments (`shards.decode_ahead.deferrable`) without
        waiting for the device: the tokens stay there for a lookahead step (`TokenBoard`), and
        the result goes once they reach the host, after the next step's kernels are queued."""
        seqs = msg["seqs"]
        if all(is_greedy(seg["sample"]["temperature"], seg["sample"]["top_k"]) for seg in seqs):
            tokens = torch.stack([out[-1] for out in outs]).argmax(dim=-1)
        else:
            tokens = torch.cat([sample_tokens(
                out[-1:], float(seg["sample"]["temperature"]), int(seg["sample"]["top_k"]),
                float(seg["sample"]["top_p"]), int(seg["sample"]["seed"]),
                [seg["pos"] + seg["n"]]) for seg, out in zip(seqs, outs)])
        if self.board is not None:  # (the last shard's: the first shard takes them there)
            self.board.post([seg["slot"] for seg in seqs], tokens, msg["sid"])
        rows = [out[-1].float()[None] for seg, out in zip(seqs, outs) if seg["logits"]]
        self.unsent.flush(wait=True)  # the steps before this one: it is queued behind them

        def send(ids: list[int], logits: torch.Tensor | None) -> None:
            outcomes = [{"token": t, "accepted": 0, "logits": seg["logits"], "path": None,
                         "asked": seg["asked"], "lp": None, "plp": None}
                        for t, seg in zip(ids, seqs)]
            if self.trace is not None:
                self.trace("sampled", msg["sid"], ahead=True)  # (its tokens on the host now)
                self.trace("sent", msg["sid"])
            try:
                self.out.send(message("result", sid=msg["sid"], outs=outcomes, act=None), logits)
            except Exception as e:  # noqa: BLE001 - reported as the step's failure
                self._report(self._failure(msg, e))

        self.unsent.add(tokens, torch.cat(rows) if rows else None, send)

    def _send_features(self, sid: int, context: int, pos: int, n: int,
                       taps: dict[int, torch.Tensor], step_end: bool) -> None:
        """Rows of the tapped layers, side by side, for the sequence's draft context
        (`context`), in pieces of at most FEED_ROWS rows; the step's last piece says so
        (`last`: the draft then has all of the step's rows)."""
        if self.feed is None:
            return
        rows = torch.cat([taps[layer] for layer in self.taps], dim=-1)
        for a in range(0, n, FEED_ROWS):
            b = min(n, a + FEED_ROWS)
            if not self._to_draft(message("feat", sid=sid, slot=context, pos=pos + a, n=b - a,
                                          layers=list(self.taps), last=step_end and b == n,
                                          act=None), rows[a:b]):
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

    def _on_sample(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Sample from logits the coordinator stored (an exact prefix hit) on this device."""
        if not self.model.is_last:
            raise ProtocolError("sample: only the last shard samples", "unexpected")
        logits = tensor_from(frames[0].buffer, {"dtype": "float32",
                                                "shape": [self.cfg.vocab_size]})
        s = msg["sample"]
        _check_sample(s, "sample", self.cfg.vocab_size)
        if s.get("late_mask"):
            raise ProtocolError("sample: a stored row's mask comes with it (late_mask)")
        x = process_logits(logits.to(self.device)[None], s)
        token = sample_rows(x, float(s["temperature"]), int(s["top_k"]), float(s["top_p"]),
                            int(s["seed"]), [msg["position"]])[0]
        lp = (None if s.get("lp") is None else
              logprob_entries(x, [token], float(s["temperature"]), s["lp"]))
        self._reply(route, message("result", sid=msg["sid"],
                                   outs=[{"token": token, "accepted": 0, "logits": False,
                                          "path": None, "asked": None, "lp": lp, "plp": None}],
                                   act=None))

    # ---- prefix cache -----------------------------------------------------------------------
    def _snap_store(self) -> SnapshotStore:
        if self.snapshots is None:
            raise ProtocolError("prefix-cache operation before configure", "unexpected")
        return self.snapshots

    def _snap_blocks(self, msg: dict[str, Any]) -> None:
        """A snap_restore or snap_load fills its slot through the block table its `blocks`
        set (checked first, then applied: the rows it writes must be in the table)."""
        if msg["type"] not in ("snap_restore", "snap_load"):
            return
        kv, slot = self.executor.kv, msg["slot"]
        if not 0 <= slot < kv.slots:
            raise ProtocolError(f"{msg['type']}: slot {slot} outside 0..{kv.slots - 1}")
        self._check_blocks(kv, slot, msg["blocks"], None, msg["type"])
        if msg["blocks"] is not None:
            self.snapshots.wait_pending()  # (copies out of the blocks it may reassign)
            kv.set_table(slot, msg["blocks"]["at"], msg["blocks"]["ids"])

    # ---- host tier of live KV ----------------------------------------------------------------
    def _on_kv_swap(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Copy a preempted sequence's blocks to the host pool (`direction` out) or back (in),
        for each [device block, host block] of `pairs`, or give back the host blocks of one
        that ended while swapped out (drop, [-1, host block]). The reply goes once the copies
        are queued: on a GPU they run on the host pool's copy stream and every kernel queued
        after them waits for them there (`shards.host_kv`), so the steps that reuse (out) or
        read (in) the device blocks run after them; on the CPU they are done."""
        if self.executor is None:
            raise ProtocolError("kv_swap before configure", "unexpected")
        if self.host_kv is None:
            raise ProtocolError("kv_swap: this shard has no host KV pool (kv_host_blocks 0)")
        direction, pairs = msg["direction"], msg["pairs"]
        if direction not in ("out", "in", "drop"):
            raise ProtocolError(f"kv_swap: direction {direction!r} must be 'out', 'in' or "
                                "'drop'")
        kv = self.executor.kv
        why = self.host_kv.pairs_error(kv, pairs, direction)
        if why is not None:
            raise ProtocolError(f"kv_swap: {why}")
        if self.snapshots is not None:
            self.snapshots.wait_pending()  # (prefix-cache copies out of blocks it overwrites)
        if direction == "drop":
            self.host_kv.drop([p[1] for p in pairs])
        elif direction == "out":
            self.host_kv.swap_out(kv, pairs)
        else:
            self.host_kv.swap_in(kv, pairs)
        self._reply(route, message("ok", info={"blocks": len(pairs)}, sid=msg.get("sid")))

    def _on_warm(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Capture the step graphs a request may replay, before any request
        (`StaticDecoder.warm`); a CPU shard, or one without graphs, has none to capture."""
        rows, batch = msg["rows"], msg["batch"]
        verify_batch = msg.get("verify_batch", 0)  # (optional: batched verify steps)
        if self.executor is None:
            raise ProtocolError("warm before configure")
        if not rows or not all(type(n) is int and 1 <= n <= self.max_step for n in rows):
            raise ProtocolError(f"warm: rows {str(rows)[:80]} must be 1..{self.max_step}")
        for name, value in (("batch", batch), ("verify_batch", verify_batch)):
            if type(value) is not int or not 0 <= value <= MAX_SLOTS:
                raise ProtocolError(f"warm: {name} {str(value)[:20]} must be 0..{MAX_SLOTS}")
        static = self.executor.static
        graphs, seconds = 0, 0.0
        if static is not None:
            rows = [n for n in rows if n <= MAX_VERIFY_ROWS]
            slots = self.executor.kv.slots
            graphs, seconds = static.warm(
                rows, min(batch, slots), label=f"shard {self.index}: ",
                verify_batch=min(verify_batch, slots) if self.executor.batch_verify else 0,
                max_rows=self.max_step)
            log.info("shard %d: %d step graphs captured in %.1f s", self.index, graphs,
                     seconds)
        if self.fused:  # the eager steps' kernel too (`shards.fused.warm_prefill`)
            warm_prefill(self.model)
        self._reply(route, message("ok", sid=msg["sid"],
                                   info={"graphs": graphs, "seconds": seconds}))

    def _on_ping(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("pong", busy=self.busy, busy_s=self.clock.seconds()))

    def _on_shutdown(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("bye"))
        self.running = False

    # ---- teardown ---------------------------------------------------------------------------
    def _drop_socket(self, sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        try:
            self.poller.unregister(sock)
        except KeyError:  # the link failed before it was registered
            pass
        sock.close(0)

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
        self.feed, self.feed_kind = None, "none"
        if self.proposals is not None:
            self.proposals.close()
        self.proposals = None
        self._drop_socket(self.feed_sock)
        self.feed_sock = None

    def _close_links(self) -> None:
        for t in (self.out, self.inbox, self.board):
            if t is not None:
                t.close()
        self.out = self.inbox = self.board = None
        self._close_feed()
        self._drop_socket(self.down)
        self.down = None
        self.transport_kind = "none"

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self._close_links()
        if not self.router.closed:
            self.router.close(0)
        if self.profile is not None:  # (last: writing it may take a while)
            self.profile.close()


SAMPLE_FIELDS = {"temperature": (int, float), "top_k": (int,), "top_p": (int, float),
                 "seed": (int,)}


def _next_proposal(seg: dict[str, Any], result: dict[str, Any]) -> dict | None:
    """What the draft will be asked to propose after this verify segment (`verdict`'s `next`):
    the segment's `then` at the position after the kept tokens, after the target's token."""
    then = seg["then"]
    if then is None or seg["draft"] is None or result["token"] is None:
        return None
    return {"pos": seg["pos"] + result["accepted"] + 1, "token": result["token"],
            "kept": rows_to_move(result["path"]),
            "n": then["n"], "tree": then["tree"], "push": then.get("push") is True}


def _sample_segment(seg: dict[str, Any], out: torch.Tensor) -> tuple[
        int, int, list[int] | None, torch.Tensor, list | None]:
    """A sampled segment's outcome from its logits `out` (rows, V): the token, the draft tokens
    kept and their tree path, the logits row the token came from, and the logprobs of the
    tokens it emitted (with the sample's `lp`; a verify segment's from its own rows, so they
    are exactly plain decoding's)."""
    sp = seg["sample"]
    temp, top_k, top_p, seed = (float(sp["temperature"]), int(sp["top_k"]),
                                float(sp["top_p"]), int(sp["seed"]))
    pos, n, k = seg["pos"], seg["n"], sp.get("lp")
    if seg["draft"] is not None:
        kept, token = accept_draft(out, seg["draft"], temp, top_k, top_p, seed, pos,
                                   seg["tree"], seg["q"])
        lp = None
        if k is not None:  # kept row j's token came from its parent row, `token` from the
            # last kept row
            parents = seg["tree"]
            src = [parents[j - 1] if parents is not None else j - 1 for j in kept]
            lp = logprob_entries(out[[*src, kept[-1] if kept else 0]],
                                 [seg["draft"][j - 1] for j in kept] + [token], temp, k)
        return (token, len(kept), kept if seg["tree"] is not None else None,
                out[kept[-1] if kept else 0], lp)
    x = process_logits(out[-1:], sp)
    token = sample_rows(x, temp, top_k, top_p, seed, [pos + n])[0]
    lp = None if k is None else logprob_entries(x, [token], temp, k)
    return token, 0, None, out[-1], lp


def _prompt_lp_ok(plp: dict[str, Any], n: int, vocab: int) -> bool:
    targets, k, temp = plp.get("targets"), plp.get("k"), plp.get("temperature")
    return (isinstance(targets, list) and len(targets) <= n
            and all(isinstance(t, int) and 0 <= t < vocab for t in targets)
            and isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= vocab
            and isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp >= 0)


def _check_sample(sample: dict[str, Any], where: str, vocab: int) -> None:
    """A segment's sampling parameters, checked before any compute (their ranges as a request's
    are: `SamplingParams`; the optional fields `shards.sampling.check_processors`)."""
    for name, types in SAMPLE_FIELDS.items():
        v = sample.get(name)
        if not isinstance(v, types) or isinstance(v, bool):
            raise ProtocolError(f"{where}: sample field {name!r} must be a number, got {v!r}")
    try:
        SamplingParams(temperature=sample["temperature"], top_k=sample["top_k"],
                       top_p=sample["top_p"], seed=sample["seed"])
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None
    bad = check_processors(sample, vocab)
    if bad is not None:
        raise ProtocolError(f"{where}: sample {bad}")


def watch_parent(parent_pid: int, on_gone) -> threading.Thread:
    """Exit when the coordinator that started us is gone (kill -9 included)."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
                log.warning("shard: coordinator %d is gone; exiting", parent_pid)
                on_gone()
                os._exit(3)
            time.sleep(0.2)

    t = threading.Thread(target=run, name="parent-watch", daemon=True)
    t.start()
    return t


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_shard(spec: ShardSpec, secret: bytes) -> int:
    """Entry point of a shard process. Exit codes: 0 clean, 2 startup error, 3 orphaned."""
    server: ShardServer | None = None

    def cleanup() -> None:  # names of rings not yet mapped by their peer
        if server is not None:
            for t in (server.inbox, server.out, server.feed, server.proposals):
                ring = getattr(t, "ring", None)
                if ring is not None:
                    ring.unlink()

    if spec.parent_pid:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator orders our shutdown
        watch_parent(spec.parent_pid, cleanup)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server = ShardServer(spec, secret)
    except Exception as e:  # noqa: BLE001 - reported through the exit code and the log
        log.error("shard %s:%s on %s failed to start: %s", spec.start, spec.end, spec.device, e)
        return 2
    log.info("shard layers %d:%d on %s listening on %s", spec.start, spec.end, spec.device,
             spec.listen)
    try:
        server.serve_forever()
    finally:
        cleanup()
        server.close()
    return 0
