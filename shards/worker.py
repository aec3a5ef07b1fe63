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
from ipc.shm import SLEEP_POLL_MS
from ipc.sockets import configure as configure_socket
from ipc.sockets import context, recv, request, send
from ipc.transport import RingSender, ZmqSender, tensor_from, zmq_tensor
from shards.checkpoint import load_layer_range, open_checkpoint
from shards.dtypes import torch_dtype
from shards.executor import RangeExecutor
from shards.fused import fuse_projections
from shards.sampling import sample_rows
from shards.snapshots import SnapshotStore, entry_path_ok

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


ALLOWED = {"coordinator": {"configure", "ping", "shutdown", "step", "sample", "wake",
                           "snap_take", "snap_restore", "snap_drop", "snap_save", "snap_load"},
           "upstream": {"link", "step", "wake"}}


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
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.peers: dict[bytes, Peer] = {}
        self.coordinator: bytes | None = None
        self.upstream: bytes | None = None
        self.down: zmq.Socket | None = None
        self.out: transport.Sender | None = None  # downstream edge, or results (last shard)
        self.inbox: transport.RingInbox | None = None  # steps, when they come through a ring
        self.executor: RangeExecutor | None = None
        self.index = -1
        self.running = True
        self.busy = False
        self.spin_s = 0.0
        self.transport_kind = "none"
        self.max_step = 0
        self.fused = False
        self.snapshots: SnapshotStore | None = None
        self.cache_dir: str | None = None
        t0 = time.perf_counter()
        ckpt = open_checkpoint(spec.model, spec.seed)
        self.cfg = ckpt.config
        self.model = load_layer_range(ckpt, spec.start, spec.end, torch_dtype(spec.dtype),
                                      self.device)
        self.load_s = time.perf_counter() - t0

    # ---- main loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        idle_since = time.monotonic()
        while self.running:
            worked = self._report_saves()
            if self.inbox is not None and self.inbox.ready():
                self._handle_inbox()
                worked = True
            if self._poll_sockets(0):
                worked = True
            now = time.monotonic()
            if worked:
                idle_since = now
                continue
            if now - idle_since < self.spin_s:
                continue
            inbox = self.inbox
            if inbox is not None:  # announce sleep, then look once more (a post may race us)
                inbox.sleep(True)
                if inbox.ready():
                    inbox.sleep(False)
                    continue
            self._poll_sockets(SLEEP_POLL_MS if inbox is not None else 200)
            if inbox is not None and inbox is self.inbox:  # (a reconfigure may have closed it)
                inbox.sleep(False)

    def _report_saves(self) -> bool:
        """Tell the coordinator about disk writes the background threads finished."""
        if self.snapshots is None or self.snapshots.results.empty():
            return False
        while not self.snapshots.results.empty():
            entry, path, sums, err = self.snapshots.results.get_nowait()
            if self.coordinator is not None:
                self._reply(self.coordinator, message("saved", entry=entry, path=path,
                                                      checksums=sums, error=err))
        return True

    def _poll_sockets(self, timeout_ms: int) -> bool:
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            if sock is self.router:
                self._handle_router()
            else:
                self._handle_downstream_reply()
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
            self._step(msg, x)
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            self._step_failed(msg, e)
        finally:
            if self.device.type == "cuda":  # kernels reading the slot must be done with it
                torch.cuda.current_stream(self.device).synchronize()
            inbox.release(seq)

    def _handle_router(self) -> None:
        route, msg, frames, err = recv(self.router, routed=True)
        assert route is not None
        if err is not None:
            self._reply(route, error(f"shard {self.index}: {err}", err.code, sid=err.sid))
            self._note_bad_upstream(route, err.sid)
            return
        t = msg["type"]
        if t == "hello":
            return self._on_hello(route, msg)
        if t == "auth":
            return self._on_auth(route, msg)
        peer = self.peers.get(route)
        if peer is None or not peer.authed:
            self._reply(route, error(f"shard {self.index}: unauthenticated peer; send hello "
                                     "and auth with the shared secret first", "unauthenticated",
                                     sid=msg.get("sid")))
            return
        if t not in ALLOWED[peer.role]:
            self._reply(route, error(f"shard {self.index}: {peer.role} may not send {t!r}",
                                     "unexpected", sid=msg.get("sid")))
            return
        try:
            if t == "step":
                expected = self.coordinator if self.model.is_first else self.upstream
                if route != expected or self.inbox is not None:
                    raise ProtocolError("step from a peer that does not feed this shard",
                                        "unexpected")
                self._step(msg, zmq_tensor(msg, frames))
            elif t != "wake":
                getattr(self, f"_on_{t}")(route, msg, frames)
        except ProtocolError as e:
            self._reply(route, error(f"shard {self.index}: {e}", e.code, sid=msg.get("sid")))
            self._note_bad_upstream(route, msg.get("sid"))
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            self._step_failed(msg, e, route)

    def _step_failed(self, msg: dict[str, Any], e: Exception, route: bytes | None = None) -> None:
        if isinstance(e, ProtocolError):
            self._report(error(f"shard {self.index}: {e}", e.code, sid=msg.get("sid")), route)
            return
        log.exception("shard %d: %s failed", self.index, msg.get("type"))
        self._report(error(f"shard {self.index} ({self.spec.start}:{self.spec.end}): "
                           f"{msg.get('type')} failed: {type(e).__name__}: {e}", "failed",
                           sid=msg.get("sid")), route)

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
    def _on_hello(self, route: bytes, msg: dict[str, Any]) -> None:
        role = msg["role"]
        if role not in ALLOWED:
            self._reply(route, error(f"unknown role {role!r}", "bad_message", sid=msg.get("sid")))
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
                                     "unauthenticated", sid=msg.get("sid")))
            return
        peer.authed = True
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
        links and snapshots are gone with it."""
        self.peers = {r: p for r, p in self.peers.items() if p.role == "coordinator"}
        self._close_links()
        if self.snapshots is not None:
            self.snapshots.wait_pending()
            self.snapshots.entries.clear()

    # ---- setup ------------------------------------------------------------------------------
    def _on_configure(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self.index = int(msg.get("index", self.index))
        self._close_links()
        max_ctx, max_step = msg["max_context"], msg["max_step_tokens"]
        if max_ctx <= 0 or max_step <= 0 or msg["slots"] != 1:
            raise ProtocolError("configure: max_context and max_step_tokens must be > 0, slots 1")
        graphs = bool(msg.get("cuda_graphs", True)) and self.device.type == "cuda"
        if self.device.type == "cuda" and not self.fused:
            fuse_projections(self.model, compile=bool(msg.get("torch_compile", True)))
            self.fused = True
        bucket = int(msg.get("graph_bucket", 256))
        self.spin_s = max(0.0, float(msg.get("spin_ms", 0.0))) / 1000.0
        ex = self.executor
        if ex is None or ex.max_len != max_ctx or (ex.static is not None) != graphs or \
                (ex.static is not None and ex.static.bucket != bucket):
            self.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.executor = RangeExecutor(self.model, max_ctx, 1, self.device,
                                          static_decode=graphs, graph_bucket=bucket)
            self.snapshots = SnapshotStore(self.executor.kv)
        self.cache_dir = msg.get("cache_dir")
        self.max_step = max_step
        info_extra: dict[str, Any] = {}
        if self.model.is_first and msg.get("inbox"):  # the coordinator shares this host
            self.inbox, desc = transport.offer("shm", max_step * 8, self.device)
            info_extra["inbox"] = desc
        nxt = msg["next"]
        if nxt is not None:
            self._link_downstream(nxt, msg["session"], msg["transport"])
        elif self.model.is_last:
            results = msg.get("results")
            if results is not None:  # the coordinator's result ring
                doorbell = lambda: self._reply(self.coordinator, message("wake"))  # noqa: E731
                self.out = transport.accept("shm", results, doorbell)
            else:
                self.out = ZmqSender(self.router, route)
        self._reply(route, message("configured", info={**self.info(), **info_extra}))

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
        reply, _ = request(self.down, message(
            "link", transport=requested, host=transport.host_id(), device=self.spec.device,
            dtype=self.spec.dtype, hidden=self.cfg.hidden_size, max_step_tokens=self.max_step,
        ), LINK_TIMEOUT_S)
        _expect(reply, "linked")
        down = self.down
        self.out = transport.accept(reply["transport"], reply["ring"],
                                    lambda: send(down, message("wake")), sock=down)
        self.transport_kind = reply["transport"]
        self.poller.register(self.down, zmq.POLLIN)

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
            "kv_capacity_tokens": ex.max_len if ex else 0,
            "kv_bytes": ex.kv.nbytes if ex else 0,
            "kv_layout": {"layers": self.spec.end - self.spec.start,
                          "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim,
                          "dtype": self.spec.dtype},
            "transport_out": self.transport_kind, "protocol": PROTOCOL_VERSION,
        }

    # ---- data plane -------------------------------------------------------------------------
    def _step(self, msg: dict[str, Any], x: torch.Tensor | None) -> None:
        if self.executor is None or self.out is None:
            raise ProtocolError("step before configure", "unexpected")
        n, pos = msg["n"], msg["pos"]
        if not 0 < n <= self.max_step or pos < 0 or pos + n > self.executor.max_len:
            raise ProtocolError(f"step: n={n} pos={pos} outside 1..{self.max_step} tokens "
                                f"within a context of {self.executor.max_len}")
        if x is None:
            raise ProtocolError("step without its tensor")
        if self.model.is_first:
            if x.dtype != torch.int64 or tuple(x.shape) != (n,):
                raise ProtocolError(f"step: expected {n} int64 token ids, got {x.dtype} "
                                    f"{tuple(x.shape)}")
            if int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size:
                raise ProtocolError(f"step: token id outside the vocabulary 0..{self.cfg.vocab_size}")
        elif tuple(x.shape) != (n, self.cfg.hidden_size):
            raise ProtocolError(f"step: activation shape {tuple(x.shape)} != "
                                f"({n}, {self.cfg.hidden_size})")
        if self.snapshots is not None and pos < self.snapshots.pending_end():
            self.snapshots.wait_pending()  # a new sequence overwrites rows still being copied
        self.busy = True
        try:
            out = self.executor.run(x, pos, msg["slot"], all_logits=False)
        finally:
            self.busy = False
        if not self.model.is_last:
            self.out.send(message("step", sid=msg["sid"], slot=msg["slot"], pos=pos, n=n,
                                  sample=msg["sample"], logits=msg["logits"], act=None), out)
            return
        logits = out[-1]
        token = None
        if msg["sample"] is not None:
            s = msg["sample"]
            token = sample_rows(logits[None], float(s["temperature"]), int(s["top_k"]),
                                float(s["top_p"]), int(s["seed"]), [pos + n])[0]
        self.out.send(message("result", sid=msg["sid"], token=token,
                              has_logits=bool(msg["logits"]), act=None),
                      logits.float().cpu() if msg["logits"] else None)

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
        self._reply(route, message("result", sid=msg["sid"], token=token, has_logits=False,
                                   act=None))

    # ---- prefix cache -----------------------------------------------------------------------
    def _snap_store(self) -> SnapshotStore:
        if self.snapshots is None:
            raise ProtocolError("prefix-cache operation before configure", "unexpected")
        return self.snapshots

    def _ok(self, route: bytes, msg: dict[str, Any], **info: Any) -> None:
        self._reply(route, message("ok", info=info, sid=msg.get("sid")))

    def _on_snap_take(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        n = self._snap_store().take(msg["entry"], msg["slot"], msg["start"], msg["end"])
        self._ok(route, msg, bytes=n)

    def _on_snap_restore(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        store = self._snap_store()
        missing = [e for e in msg["entries"] if e not in store.entries]
        if missing:
            raise ProtocolError(f"snap_restore: no snapshot {missing[0]} on this shard",
                                "unknown_entry")
        store.wait_pending()
        for e in msg["entries"]:
            store.restore(e, msg["slot"])
        self._ok(route, msg)

    def _on_snap_drop(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        store = self._snap_store()
        for e in msg["entries"]:
            store.drop(e)
        self._ok(route, msg, bytes=store.nbytes)

    def _file_items(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        if not entry_path_ok(msg["path"], self.cache_dir):
            raise ProtocolError(f"{msg['path']} is outside the cache directory", "bad_path")
        items = msg["items"]
        nl = self.spec.end - self.spec.start
        for it in items:
            if not isinstance(it, dict) or not isinstance(it.get("layer"), int) or \
                    not 0 <= it["layer"] < nl or it.get("kind") not in ("k", "v") or \
                    not isinstance(it.get("offset"), int) or it["offset"] < 0:
                raise ProtocolError(f"bad cache-file item {it!r}")
        return items

    def _on_snap_save(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        store = self._snap_store()
        if msg["entry"] not in store.entries:
            raise ProtocolError(f"snap_save: no snapshot {msg['entry']}", "unknown_entry")
        store.save(msg["entry"], msg["path"], self._file_items(msg))
        self._ok(route, msg)

    def _on_snap_load(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        store = self._snap_store()
        store.wait_pending()
        try:
            n = store.load(msg["path"], msg["slot"], self._file_items(msg))
        except (OSError, ValueError) as e:
            self._ok(route, msg, error=f"{type(e).__name__}: {e}")
            return
        self._ok(route, msg, bytes=n)

    def _on_ping(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("pong", busy=self.busy))

    def _on_shutdown(self, route: bytes, msg: dict[str, Any], frames: list) -> None:
        self._reply(route, message("bye"))
        self.running = False

    # ---- teardown ---------------------------------------------------------------------------
    def _close_links(self) -> None:
        for t in (self.out, self.inbox):
            if t is not None:
                t.close()
        self.out = self.inbox = None
        if self.down is not None:
            down, self.down = self.down, None
            try:
                self.poller.unregister(down)
            except KeyError:  # the link failed before it was registered
                pass
            down.close(0)
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

    def cleanup() -> None:  # names of rings not yet mapped by their peer
        if server is not None:
            for t in (server.inbox, server.out):
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
