"""A shard process: owns layers [start, end) and their KV cache.

Inbound: one zmq ROUTER socket for control (from the coordinator), link setup and zmq-transport
steps (from the upstream shard); and, on one host, a shared-memory ring (`ipc.transport.RingInbox`)
that carries the steps themselves. Every zmq peer must first prove it holds the shared secret
(`ipc.auth`). Outbound: the step's output goes to the downstream shard over the edge's transport;
the last shard sends the sampled token (and logits when asked) to the coordinator.

The loop spins on its inbox for `spin_ms` after the last message (no wake-up latency on the
decode path), then sleeps on the ROUTER socket until a doorbell or a control message arrives.

This module holds the loop, the peers and the process's entry point (`run_shard`); the server's
other jobs are a module each: `shards.worker_setup` (configure, links, graphs at start),
`shards.worker_steps` (step execution), `shards.worker_sampling` (the last shard's sampling),
`shards.worker_cache` (prefix-cache snapshots and the host tier of live KV).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time
from typing import Any

import torch
import zmq
from layersplit.ipc import transport
from layersplit.ipc.messages import ProtocolError, error, message
from layersplit.ipc.parent_watch import watch_parent
from layersplit.ipc.peers import AUTH_FAILED, Gate
from layersplit.ipc.serve_loop import serve
from layersplit.ipc.sockets import bind_router, context, recv, send
from layersplit.ipc.step_trace import step_trace
from layersplit.ipc.token_board import TokenBoard
from layersplit.ipc.transport import zmq_tensor
from layersplit.shards import hybrid_prewarm
from layersplit.shards.asked import asked
from layersplit.shards.busy_clock import BusyClock
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.decode_ahead import UnsentResults
from layersplit.shards.device import use_device
from layersplit.shards.dtypes import torch_dtype
from layersplit.shards.early_moves import EarlyMoves
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.host_kv import HostKVPool
from layersplit.shards.kernel_profile import kernel_profile
from layersplit.shards.parked_rows import ParkedRows
from layersplit.shards.snapshots import SNAP_OPS, SnapshotStore, block_ms, snap_op
from layersplit.shards.worker_cache import ShardCacheOps
from layersplit.shards.worker_sampling import LastShardSampling
from layersplit.shards.worker_setup import ShardSetup
from layersplit.shards.worker_steps import StepRunner

log = logging.getLogger("layersplit.shard")
MASK_WAIT_S = 10.0  # the last shard waits this long for a step's late grammar masks, then fails it
AHEAD_POLL_S = 1e-3  # a CPU shard's sleep between looks at the board while it holds a step


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
    weight_format: str = "dequantize"  # or "quantized" (`shards.quant_load`)
    heartbeat_s: float | None = None  # zmq heartbeats on our sockets (a shard started by hand
    # on another host); None for a shard the coordinator started here: it watches the process


ALLOWED = {"coordinator": {"configure", "ping", "shutdown", "step", "sample", "mask", "wake",
                           "draft_gone", "kv_swap", "warm", "warm_prefill", "void", "unpark",
                           *SNAP_OPS},
           "upstream": {"link", "step", "wake"}}


class ShardServer(StepRunner, LastShardSampling, ShardCacheOps, ShardSetup):
    """One shard process's server: the message loop (`serve_forever`, `_handle_router`,
    `_handle_inbox`), the peers it authenticates and the errors it reports. Its parts:
    `shards.worker_setup` (configure, links, warm), `shards.worker_steps` (step execution),
    `shards.worker_sampling` (the last shard's sampling), `shards.worker_cache` (snapshots
    and the host KV tier); the state of all of them is set here, in `__init__`."""

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
        self.parked = ParkedRows()  # feature rows of parked steps (`shards.parked_rows`)
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
        # (a hybrid range on a GPU, a machine's first start: its prefill kernels compiled by
        # a process of their own, beside this one's start; `shards.hybrid_prewarm`)
        self.prewarm = hybrid_prewarm.spawn(self.cfg, spec.start, spec.end, self.device,
                                            spec.dtype)
        try:
            self.model = load_layer_range(ckpt, spec.start, spec.end, torch_dtype(spec.dtype),
                                          self.device, spec.weight_format)
        except BaseException:
            hybrid_prewarm.stop(self.prewarm)
            raise
        self.load_s = time.perf_counter() - t0

    # ---- main loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        serve(lambda: self.running, self._work,
              lambda: [r for r in (self.inbox, self.proposals) if r is not None],
              lambda ms: self._poll_sockets(block_ms(self.snapshots, ms)), lambda: self.spin_s)

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
                if t == "snap_take":  # (the draft's snapshot waits for the rows parked here)
                    self._send_parked(True)
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

    # ---- liveness and shutdown ------------------------------------------------------------------
    def _on_unpark(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._send_parked(True)
        self._reply(route, message("ok", info={}, sid=msg.get("sid")))

    def _on_ping(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("pong", busy=self.busy, busy_s=self.clock.seconds()))

    def _on_shutdown(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("bye"))
        self.running = False

    def close(self) -> None:
        hybrid_prewarm.stop(self.prewarm)
        if self.trace is not None:
            self.trace.close()
        self._close_links()
        if not self.router.closed:
            self.router.close(0)
        if self.profile is not None:  # (last: writing it may take a while)
            self.profile.close()


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
