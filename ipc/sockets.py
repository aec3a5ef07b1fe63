"""zmq sockets and framing: one place that sends and receives protocol messages."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import zmq
from layersplit.ipc.curve import needs_curve, secure_client, secure_server
from layersplit.ipc.messages import ProtocolError, best_effort_sid, decode, encode, message

MIN_HEARTBEAT_IVL_MS = 100
MAX_MESSAGE_BYTES = 4 << 30  # zmq drops a peer that sends a larger message
RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 10, 100  # a client's retries of a peer not yet bound


def context() -> zmq.Context:
    return zmq.Context.instance()


RUN_DIR_PREFIX = "layersplit-"


def run_dir() -> Path:
    """A private (0700) directory for this process's ipc:// sockets; the pid keeps tests apart.
    The directories of processes that are gone (killed before they could remove theirs: the
    coordinator removes its own at close) are removed first."""
    remove_stale_run_dirs()
    d = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
    d.chmod(0o700)
    return d


def remove_stale_run_dirs() -> list[Path]:
    """Remove the `run_dir` directories in the temp folder whose process no longer exists and
    that this user owns (a process of another PID namespace sharing the folder would look
    gone: containers that share /tmp should not share a user); returns those removed."""
    gone = []
    uid = os.getuid()
    for d in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*-*"):
        pid = d.name[len(RUN_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != uid:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure(sock: zmq.Socket, identity: bytes | None = None,
              heartbeat_s: float | None = None) -> zmq.Socket:
    """Our socket options. With `heartbeat_s`, zmq heartbeats drop a peer that has not answered
    for that long (remote peers: a host or link gone silent). Processes of one host are watched
    through their process instead (`runtime.supervisor`): a heartbeat's fixed timeout cannot
    tell a hung peer from a starved one on a loaded machine, and tore healthy CPU runs down."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if heartbeat_s:
        timeout_ms = max(int(heartbeat_s * 1000), 2 * MIN_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(MIN_HEARTBEAT_IVL_MS, timeout_ms // 5))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def bind_router(listen: str, secret: bytes, heartbeat_s: float | None = None) -> zmq.Socket:
    """A server's socket: every peer by its identity; replies to a departed peer raise. On a
    tcp:// address it is a CurveZMQ server keyed by `secret` (`ipc.curve`); `heartbeat_s`: see
    `configure`."""
    sock = configure(context().socket(zmq.ROUTER), heartbeat_s=heartbeat_s)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if needs_curve(listen):
        secure_server(sock, secret)
    sock.bind(listen)
    return sock


def connect_dealer(ctx: zmq.Context, address: str, secret: bytes,
                   identity: bytes | None = None, heartbeat_s: float | None = None) -> zmq.Socket:
    """A client's socket connected to a server of this run (encrypted on tcp://, `ipc.curve`);
    `heartbeat_s`: see `configure`."""
    sock = configure(ctx.socket(zmq.DEALER), identity=identity, heartbeat_s=heartbeat_s)
    # a peer started with this socket (a shard, the draft) binds a moment after our connect:
    # retry within 10 ms, backing off to zmq's usual 100 ms (its default, a fixed 100 ms, cost
    # every start up to 0.1 s per shard)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if needs_curve(address):
        secure_client(sock, secret)
    sock.connect(address)
    return sock


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a socket and the PAIR socket its monitor reports on (`get_monitor_socket`).

    The monitor is switched off first: zmq's I/O thread sends each event to the PAIR with a
    blocking send, holding the socket's monitor lock, so an event (a peer's disconnect) that
    came after the PAIR was closed blocked that thread for good, and `disable_monitor` after
    it waited on the lock for ever (a close that hung after shards were killed)."""
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)


def send(sock: zmq.Socket, msg: dict[str, Any], frames: Sequence[Any] = (),
         route: bytes | None = None,
         pack: Callable[[dict[str, Any]], bytes] = encode) -> None:
    """Send one message (`pack`: a packer the caller keeps, `messages.encoder`)."""
    parts: list[Any] = [] if route is None else [route]
    parts.append(pack(msg))
    parts.extend(frames)
    sock.send_multipart(parts, copy=False)


def ring_doorbell(sock: zmq.Socket, route: bytes | None = None) -> None:
    """Wake a shared-memory ring's sleeping reader (a `wake` message). Never blocks: at the
    socket's high-water mark the reader has wakes queued already, and a reader gone needs none;
    a blocking doorbell could wait forever on a peer that is itself waiting on this side."""
    parts: list[Any] = [] if route is None else [route]
    parts.append(encode(message("wake")))
    try:
        sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
    except zmq.ZMQError:  # (Again at the high-water mark; a departed peer)
        pass


def recv(sock: zmq.Socket, routed: bool = False) -> tuple[bytes | None, dict[str, Any] | None,
                                                          list[zmq.Frame], ProtocolError | None]:
    """Receive one whole multipart message: (route, msg, payload frames, error).

    A message that fails validation comes back with msg=None and the error (its `sid` attribute
    holds the rejected message's sid when readable); it has been read completely, so the next
    recv starts at the next message."""
    parts = sock.recv_multipart(copy=False)
    route = None
    if routed:
        route, parts = parts[0].bytes, parts[1:]
    if not parts:
        return route, None, [], ProtocolError("empty message", "malformed")
    try:
        msg = decode(parts[0].buffer, len(parts) - 1)
    except ProtocolError as e:
        e.sid = best_effort_sid(parts[0].buffer)
        return route, None, [], e
    return route, msg, parts[1:], None


def request(sock: zmq.Socket, msg: dict[str, Any], timeout_s: float,
            frames: Sequence[Any] = ()) -> tuple[dict[str, Any], list[zmq.Frame]]:
    """Send and wait for the reply on a DEALER socket; raise TimeoutError or ProtocolError."""
    send(sock, msg, frames)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000)):
            raise TimeoutError(f"no reply to {msg['type']!r} within {timeout_s:.1f} s")
        _, reply, payload, err = recv(sock)
        if err is not None:
            raise err
        return reply, payload
