"""A shard process: owns layers [start, end) and their KV cache, serves one zmq ROUTER socket.

Everything that reaches the shard arrives on that socket: control requests from the coordinator,
activations (or their notifications) from the upstream shard, link setup from the upstream shard.
Every peer must first prove it holds the shared secret (`ipc.auth`). The shard forwards its
output to the downstream shard over the edge's transport; the last shard sends sampled tokens
(and logits when asked) back to the coordinator.
"""

from __future__ import annotations

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

from ipc import auth, transport
from ipc.messages import PROTOCOL_VERSION, ProtocolError, error, message
from ipc.sockets import configure as configure_socket
from ipc.sockets import context, recv, request, send
from ipc.transport import tensor_bytes, tensor_from
from shards.checkpoint import load_layer_range, open_checkpoint
from shards.dtypes import torch_dtype
from shards.executor import RangeExecutor
from shards.sampling import sample_rows

log = logging.getLogger("layersplit.shard")
LINK_TIMEOUT_S = 60.0


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


@dataclasses.dataclass(slots=True)
class Peer:
    role: str
    nonce: bytes
    client_nonce: bytes
    authed: bool = False


class ShardServer:
    def __init__(self, spec: ShardSpec, secret: bytes) -> None:
        self.spec, self.secret = spec, secret
        self.device = torch.device(spec.device)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ctx = context()
        self.router = configure_socket(self.ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(spec.listen)
        self.peers: dict[bytes, Peer] = {}
        self.coordinator: bytes | None = None
        self.upstream: bytes | None = None
        self.down: zmq.Socket | None = None
        self.sender: transport.Sender | None = None
        self.receiver: transport.Receiver | None = None
        self.pending_receiver: transport.Receiver | None = None
        self.executor: RangeExecutor | None = None
        self.index = -1
        self.running = True
        self.busy = False
        self.transport_kind = "none"
        t0 = time.perf_counter()
        ckpt = open_checkpoint(spec.model, spec.seed)
        self.cfg = ckpt.config
        self.model = load_layer_range(ckpt, spec.start, spec.end, torch_dtype(spec.dtype),
                                      self.device)
        self.load_s = time.perf_counter() - t0

    # ---- main loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while self.running:
            if self.down is not None and self.down not in dict(poller.sockets):
                poller.register(self.down, zmq.POLLIN)
            for sock, _ in poller.poll(200):
                if sock is self.router:
                    self._handle_router()
                else:
                    self._handle_downstream_reply()

    def _handle_router(self) -> None:
        route, msg, frames, err = recv(self.router, routed=True)
        assert route is not None
        if err is not None:
            self._reply(route, error(f"shard {self.index}: {err}", err.code, sid=err.sid))
            self._note_bad_frame(route, None, err.sid)
            return
        t = msg["type"]
        peer = self.peers.get(route)
        if t == "hello":
            return self._on_hello(route, msg)
        if t == "auth":
            return self._on_auth(route, msg)
        if peer is None or not peer.authed:
            self._reply(route, error(f"shard {self.index}: unauthenticated peer; send hello "
                                     "and auth with the shared secret first", "unauthenticated"))
            return
        handler = getattr(self, f"_on_{t}", None)
        allowed = {"coordinator": {"configure", "ping", "shutdown", "step", "sample"},
                   "upstream": {"link", "link_done", "step"}}[peer.role]
        if handler is None or t not in allowed:
            self._reply(route, error(f"shard {self.index}: {peer.role} may not send {t!r}",
                                     "unexpected"))
            return
        try:
            handler(route, msg, frames)
        except ProtocolError as e:
            sid = msg.get("sid")
            self._reply(route, error(f"shard {self.index}: {e}", e.code, sid=sid))
            self._note_bad_frame(route, msg, sid)
        except Exception as e:  # report, keep serving
            log.exception("shard %d: %s failed", self.index, t)
            self._report(error(f"shard {self.index} ({self.spec.start}:{self.spec.end}): "
                               f"{t} failed: {type(e).__name__}: {e}", "failed",
                               sid=msg.get("sid")), route)

    def _note_bad_frame(self, route: bytes, msg: dict | None, sid: int | None) -> None:
        """A rejected message from the linked upstream shard: consume it from the ring so both
        ends stay in step, and tell the coordinator, whose step it was."""
        if route != self.upstream or self.upstream is None:
            return
        act = msg.get("act") if msg else None
        reset = getattr(self.receiver, "reset_after_error", None)
        if reset is not None:
            reset(act)
        if self.coordinator is not None:
            self._reply(self.coordinator, error(
                f"shard {self.index}: rejected a malformed message from its upstream shard",
                "bad_upstream", sid=sid))

    def _handle_downstream_reply(self) -> None:
        """Errors the downstream shard sends back to us go to the coordinator."""
        assert self.down is not None
        _, msg, _, err = recv(self.down)
        if err is not None:
            msg = error(f"shard {self.index}: malformed reply from downstream: {err}", err.code)
        if self.coordinator is not None:
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
    def _on_hello(self, route: bytes, msg: dict[str, Any]) -> None:
        role = msg["role"]
        if role not in ("coordinator", "upstream"):
            self._reply(route, error(f"unknown role {role!r}", "bad_message"))
            return
        peer = Peer(role, auth.new_nonce(), msg["nonce"])
        self.peers[route] = peer
        self._reply(route, message("challenge", nonce=peer.nonce))

    def _on_auth(self, route: bytes, msg: dict[str, Any]) -> None:
        peer = self.peers.get(route)
        if peer is None or not auth.verify(self.secret, peer.nonce, peer.client_nonce, peer.role,
                                           msg["mac"]):
            self.peers.pop(route, None)
            log.warning("shard: refused a peer that failed authentication")
            self._reply(route, error("authentication failed: wrong shared secret",
                                     "unauthenticated"))
            return
        peer.authed = True
        if peer.role == "coordinator":
            if self.coordinator is not None and self.coordinator != route:
                self._reset_session()
            self.coordinator = route
        self._reply(route, message("welcome", index=self.index,
                                   layers=[self.spec.start, self.spec.end],
                                   device=self.spec.device, pid=os.getpid()))

    def _reset_session(self) -> None:
        """A new coordinator took over (remote shards outlive coordinators)."""
        self.peers = {r: p for r, p in self.peers.items() if p.role == "coordinator"}
        self._close_links()
        self.upstream = None

    # ---- setup ------------------------------------------------------------------------------
    def _on_configure(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self.index = int(msg.get("index", self.index))
        self._close_links()
        max_ctx, max_step = msg["max_context"], msg["max_step_tokens"]
        if max_ctx <= 0 or max_step <= 0 or msg["slots"] != 1:
            raise ProtocolError("configure: max_context and max_step_tokens must be > 0, slots 1")
        graphs = bool(msg.get("cuda_graphs", True)) and self.device.type == "cuda"
        bucket = int(msg.get("graph_bucket", 256))
        ex = self.executor
        if ex is None or ex.max_len != max_ctx or (ex.static is not None) != graphs or \
                (ex.static is not None and ex.static.bucket != bucket):
            self.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.executor = RangeExecutor(self.model, max_ctx, 1, self.device,
                                          static_decode=graphs, graph_bucket=bucket)
        self.max_step = max_step
        nxt = msg["next"]
        if nxt is not None:
            self._link_downstream(nxt, msg["session"], msg["transport"])
        self._reply(route, message("configured", info=self.info()))

    def _link_downstream(self, nxt: dict[str, Any], session: bytes, requested: str) -> None:
        addr = nxt.get("address")
        if not isinstance(addr, str):
            raise ProtocolError("configure: next.address must be a string")
        ident = f"shard{self.index}-".encode() + session[:8] + os.urandom(4)
        self.down = configure_socket(self.ctx.socket(zmq.DEALER), identity=ident)
        self.down.connect(addr)
        nonce = auth.new_nonce()
        reply, _ = request(self.down, message("hello", nonce=nonce, role="upstream"), LINK_TIMEOUT_S)
        _expect(reply, "challenge")
        mac = auth.mac(self.secret, reply["nonce"], nonce, "upstream")
        reply, _ = request(self.down, message("auth", mac=mac), LINK_TIMEOUT_S)
        _expect(reply, "welcome")
        hidden = self.cfg.hidden_size
        reply, _ = request(self.down, message(
            "link", transport=requested, host=transport.host_id(), device=self.spec.device,
            dtype=self.spec.dtype, hidden=hidden, max_step_tokens=self.max_step,
        ), LINK_TIMEOUT_S)
        _expect(reply, "linked")
        self.sender = transport.accept(reply["transport"], reply["ring"])
        self.transport_kind = reply["transport"]
        reply, _ = request(self.down, message("link_done"), LINK_TIMEOUT_S)
        _expect(reply, "bye")

    def _on_link(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        try:
            kind = transport.resolve(msg["transport"], msg["host"], msg["device"], self.spec.device)
        except ValueError as e:
            raise ProtocolError(str(e), "bad_transport") from e
        if msg["hidden"] != self.cfg.hidden_size:
            raise ProtocolError(f"link: hidden size {msg['hidden']} != {self.cfg.hidden_size}")
        itemsize = torch.empty((), dtype=transport.DTYPES[msg["dtype"]]).element_size()
        slot_bytes = msg["max_step_tokens"] * msg["hidden"] * itemsize
        if self.receiver is not None:
            self.receiver.close()
        self.receiver, ring = transport.offer(kind, slot_bytes, self.device)
        self.upstream = route  # the peer that linked is the one whose steps we take
        self.pending_receiver = self.receiver
        self._reply(route, message("linked", transport=kind, ring=ring))

    def _on_link_done(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        ring = getattr(self.pending_receiver, "ring", None)
        if ring is not None:
            ring.unlink()  # both ends have it mapped: the name is no longer needed
        self.pending_receiver = None
        self._reply(route, message("bye"))

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
            "kv_capacity_tokens": ex.max_len if ex else 0,
            "kv_bytes": ex.kv.nbytes if ex else 0,
            "kv_layout": {"layers": self.spec.end - self.spec.start,
                          "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim,
                          "dtype": self.spec.dtype},
            "transport_out": self.transport_kind, "protocol": PROTOCOL_VERSION,
        }

    # ---- data plane -------------------------------------------------------------------------
    def _on_step(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        if self.executor is None:
            raise ProtocolError("step before configure", "unexpected")
        n, pos = msg["n"], msg["pos"]
        if not 0 < n <= self.max_step or pos < 0 or pos + n > self.executor.max_len:
            raise ProtocolError(f"step: n={n} pos={pos} outside 1..{self.max_step} tokens "
                                f"within a context of {self.executor.max_len}")
        first = self.model.is_first
        expected_route = self.coordinator if first else self.upstream
        if route != expected_route:
            raise ProtocolError("step from a peer that does not feed this shard", "unexpected")
        act = msg["act"]
        if first:
            if len(frames) != 1:
                raise ProtocolError(f"step: expected 1 token frame, got {len(frames)}")
            x = tensor_from(frames[0].buffer, {"dtype": "int64", "shape": [n]})
            if int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size:
                raise ProtocolError(f"step: token id outside the vocabulary 0..{self.cfg.vocab_size}")
        else:
            if self.receiver is None or not isinstance(act, dict):
                raise ProtocolError("step: no activation descriptor or no link")
            x = self.receiver.read(act, frames)
            if tuple(x.shape) != (n, self.cfg.hidden_size):
                self.receiver.release(act)
                raise ProtocolError(f"step: activation shape {tuple(x.shape)} != "
                                    f"({n}, {self.cfg.hidden_size})")
        self.busy = True
        try:
            out = self.executor.run(x, pos, msg["slot"], all_logits=False)
        finally:
            self.busy = False
            if not first:
                self.receiver.release(act)
        if not self.model.is_last:
            header = message("step", sid=msg["sid"], slot=msg["slot"], pos=pos, n=n,
                             sample=msg["sample"], logits=msg["logits"], act=None)
            assert self.sender is not None and self.down is not None
            self.sender.send(self.down, header, out)
            return
        logits = out[-1]
        token = None
        if msg["sample"] is not None:
            s = msg["sample"]
            token = sample_rows(logits[None], float(s["temperature"]), int(s["top_k"]),
                                float(s["top_p"]), int(s["seed"]), [pos + n])[0]
        frames_out = [tensor_bytes(logits.float().cpu())] if msg["logits"] else []
        self._reply(self.coordinator, message("result", sid=msg["sid"], token=token,
                                              has_logits=bool(msg["logits"])), frames_out)

    def _on_sample(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        """Sample from logits the coordinator stored (an exact prefix hit) on this device."""
        if not self.model.is_last:
            raise ProtocolError("sample: only the last shard samples", "unexpected")
        logits = tensor_from(frames[0].buffer, {"dtype": "float32",
                                                "shape": [self.cfg.vocab_size]})
        s = msg["sample"]
        token = sample_rows(logits.to(self.device)[None], float(s["temperature"]),
                            int(s["top_k"]), float(s["top_p"]), int(s["seed"]),
                            [msg["position"]])[0]
        self._reply(route, message("result", sid=msg["sid"], token=token, has_logits=False))

    def _on_ping(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("pong", busy=self.busy))

    def _on_shutdown(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("bye"))
        self.running = False

    # ---- teardown ---------------------------------------------------------------------------
    def _close_links(self) -> None:
        for t in (self.sender, self.receiver):
            if t is not None:
                t.close()
        self.sender = self.receiver = self.pending_receiver = None
        if self.down is not None:
            self.down.close(0)
            self.down = None
        self.transport_kind = "none"

    def close(self) -> None:
        self._close_links()
        if not self.router.closed:
            self.router.close(0)


def _expect(reply: dict[str, Any], t: str) -> None:
    if reply.get("type") != t:
        detail = reply.get("message") if reply.get("type") == "error" else reply.get("type")
        raise ProtocolError(f"expected {t!r} from the downstream shard, got: {detail}")


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

    def cleanup() -> None:
        if server is not None and server.receiver is not None:
            ring = getattr(server.receiver, "ring", None)
            if ring is not None:
                ring.unlink()

    if spec.parent_pid:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator orders our shutdown
        watch_parent(spec.parent_pid, cleanup)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server = ShardServer(spec, secret)
    except Exception as e:
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
