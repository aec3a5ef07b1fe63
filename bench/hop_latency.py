"""Hop latency of each activation transport: one-way time for `tokens x hidden` activations.

Two processes ping-pong an activation over the real transport classes (`ipc/transport.py`),
each edge set up as the runtime sets it up (receiver offers, sender maps). One-way latency is
half the round trip, which ends once the echo has landed on the first side's device (its stream
synchronized: every copy of the trip, and each side's wait for the other's, has run).
Ring transports (shm, cuda-ipc) are waited on by spinning, as the runtime does on GPU hosts
(`--no-spin`: sleep on the zmq doorbell instead, as on CPU-only hosts).

    python bench/hop_latency.py --devices cpu,cpu --transports zmq-ipc,zmq-tcp,shm
    python bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc,shm,zmq-ipc

`cuda-ipc-sync` is a cuda-ipc edge without its IPC events, both sides synchronizing on the host
instead (as where a platform has none): the same run then says what the events' ordering of
the two streams costs against host waits.

Across two hosts (`bench/ray_netns.py` runs it between two network namespaces): `--bind HOST`
is the address this side's zmq-tcp socket binds, `--peer-prefix` the command the peer is started
under (e.g. `ip netns exec NS`), and `--curve` keys both ends as every tcp edge of a run is
(CurveZMQ, `ipc/curve.py`).

Prints a table last; `--json FILE` also writes the rows.

`--in-process` times the host side of a hop alone, without a peer (a busy machine's
scheduling does not enter it): `send()`, and the receiving side's take (a ring's `poll()` +
`release()`; zmq's `recv()` + the tensor's view, once delivered) of one edge in this process,
medians over `--iters` messages (shm's send path is the one cuda-ipc shares, its device copy
aside):

    python bench/hop_latency.py --in-process --transports shm,zmq-ipc --tokens 1 --hidden 4096 \
        --iters 20000
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from layersplit.ipc import auth, cuda_handoff, transport  # noqa: E402
from layersplit.ipc.curve import secure_client, secure_server  # noqa: E402
from layersplit.ipc.messages import message, segment  # noqa: E402
from layersplit.ipc.sockets import free_tcp_port, recv, run_dir  # noqa: E402

DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _setup(sock: zmq.Socket, kind: str, max_bytes: int, dev: torch.device):
    """Exchange ring offers with the peer: returns (sender, inbox or None) of this side."""
    rkind = "zmq" if kind.startswith("zmq") else "cuda-ipc" if kind.startswith("cuda-ipc") else kind
    # cuda-ipc-sync: both sides as on a platform without IPC events (the sender synchronizes its
    # copy, the receiver its stream before a slot goes back): what the events' ordering costs
    cuda_handoff.IPC_EVENTS_OFF = kind == "cuda-ipc-sync"
    inbox, desc = transport.offer(rkind, max_bytes, dev)
    sock.send(msgpack.packb({"desc": desc}, use_bin_type=True))
    peer = msgpack.unpackb(sock.recv(), raw=False)
    sender = transport.accept(rkind, peer["desc"], lambda: sock.send(b"wake"), sock=sock)
    sock.send(b"mapped")
    assert sock.recv() == b"mapped"
    return sender, inbox


def _take(sock, inbox, dev, spin):
    """The next activation on this side: (tensor usable in `dev`'s stream order, a callable that
    hands its ring slot back)."""
    if inbox is None:
        _, msg, frames, err = recv(sock)
        assert err is None, err
        return transport.zmq_tensor(msg, frames).to(dev), lambda: None
    while True:
        if inbox.ready():
            msg, y, seq = inbox.poll()
            return y, functools.partial(inbox.release, seq)
        if not spin:
            inbox.sleep(True)
            if not inbox.ready():
                sock.poll(2)
                while sock.poll(0):
                    sock.recv()  # doorbells
            inbox.sleep(False)


def _step(n):
    return message("step", sid=0, seqs=[segment(0, 0, n)], act=None)


def _round_trip(sock, sender, inbox, x, dev, spin) -> tuple[float, torch.Tensor, tuple]:
    """Send `x` and take the peer's echo; the clock stops once the echo is on this device
    (a stream sync: the echo's copies, and the peer's, have run). Also returns the time of this
    side's send call and of the final sync."""
    t0 = time.perf_counter()
    sender.send(_step(x.shape[0]), x)
    t1 = time.perf_counter()
    y, done = _take(sock, inbox, dev, spin)
    t2 = time.perf_counter()
    _sync(dev)
    t3 = time.perf_counter()
    y = y.clone()
    done()
    return t3 - t0, y, (t1 - t0, t3 - t2)


def peer_main(args) -> None:
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    if args.curve:
        secure_client(sock, auth.load_secret(None))
    sock.connect(args.address)
    while True:
        cmd = msgpack.unpackb(sock.recv(), raw=False)
        if cmd["op"] == "stop":
            break
        sender, inbox = _setup(sock, cmd["kind"], cmd["max_bytes"], dev)
        for _ in range(cmd["iters"]):  # echo straight out of the slot, as a shard forwards
            y, done = _take(sock, inbox, dev, cmd["spin"])
            sender.send(_step(y.shape[0]), y)
            done()
        _sync(dev)
        sender.close()
        if inbox is not None:
            inbox.close()


def _in_process_pair(kind: str, x: torch.Tensor, where: Path):
    """(sender, wait, take, close) of one edge in this process: `wait()` returns once a message
    sent is there to take (zmq: delivered by its I/O thread, a transit not timed), `take()`
    takes it (the tensor, and its ring slot handed back)."""
    if kind == "shm":
        inbox, desc = transport.offer("shm", x.numel() * x.element_size(), x.device)
        sender = transport.accept("shm", desc, None)

        def take():
            _, y, seq = inbox.poll()
            inbox.release(seq)
            return y

        def close():
            sender.close()
            inbox.close()
        return sender, lambda: None, take, close
    if kind not in ("zmq-ipc", "zmq-tcp"):
        raise SystemExit(f"--in-process times shm, zmq-ipc and zmq-tcp, not {kind}")
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = (f"tcp://127.0.0.1:{free_tcp_port()}" if kind == "zmq-tcp"
            else f"ipc://{where}/in.sock")
    a.bind(addr)
    b.connect(addr)
    sender = transport.accept("zmq", None, None, sock=a)

    def take():
        _, msg, frames, err = recv(b)
        assert err is None, err
        return transport.zmq_tensor(msg, frames)

    def close():
        a.close(0)
        b.close(0)
    return sender, lambda: b.poll(-1), take, close


def in_process(args) -> None:
    """`--in-process`: the medians of send() and of the receiving side's take (ring: poll() +
    release(); zmq: recv() + the tensor's view, once delivered) of one edge in this process."""
    print(f"{'transport':<10} {'hidden':>6} {'tokens':>6} {'send us':>8} {'take us':>8}")
    where = run_dir()
    for kind in args.transports.split(","):
        for hidden in map(int, args.hidden.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                x = torch.randn(tokens, hidden)
                sender, wait, take, close = _in_process_pair(kind, x, where)
                sends, takes = [], []
                for i in range(args.iters + 100):
                    header = _step(tokens)
                    t0 = time.perf_counter_ns()
                    sender.send(header, x)
                    t1 = time.perf_counter_ns()
                    wait()
                    t2 = time.perf_counter_ns()
                    y = take()
                    t3 = time.perf_counter_ns()
                    if i >= 100:
                        sends.append(t1 - t0)
                        takes.append(t3 - t2)
                assert torch.equal(y, x)
                close()
                print(f"{kind:<10} {hidden:>6} {tokens:>6} {statistics.median(sends) / 1e3:>8.2f} "
                      f"{statistics.median(takes) / 1e3:>8.2f}")
    os.rmdir(where) if not os.listdir(where) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--transports", default="zmq-ipc,zmq-tcp,shm")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--hidden", default="576,4096,8192")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-spin", action="store_true")
    ap.add_argument("--bind", default="127.0.0.1", help="zmq-tcp: the address this side binds")
    ap.add_argument("--peer-prefix", default="", help="command the peer runs under")
    ap.add_argument("--curve", action="store_true", help="zmq-tcp: CurveZMQ, as a run's edges")
    ap.add_argument("--in-process", action="store_true",
                    help="time send() and the take of one edge (shm, zmq-*) in this process")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_main(args)
    if args.in_process:
        return in_process(args)
    d0, d1 = args.devices.split(",")
    dev = torch.device(d0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = DTYPE[dev.type]
    rows = []
    for kind in args.transports.split(","):
        where = run_dir()
        addr = (f"tcp://{args.bind}:{free_tcp_port(args.bind)}" if kind == "zmq-tcp"
                else f"ipc://{where}/hop.sock")
        sock = zmq.Context.instance().socket(zmq.PAIR)
        env = dict(os.environ)
        if args.curve and kind == "zmq-tcp":  # (the peer reads the secret from its environment)
            secret = auth.new_secret()
            env[auth.SECRET_ENV] = secret.hex()
            secure_server(sock, secret)
        sock.bind(addr)
        peer = subprocess.Popen([*shlex.split(args.peer_prefix), sys.executable, __file__,
                                 "--peer", "--address", addr, "--device", d1,
                                 *(["--curve"] if args.curve and kind == "zmq-tcp" else [])],
                                env=env)
        try:
            for hidden in map(int, args.hidden.split(",")):
                for tokens in map(int, args.tokens.split(",")):
                    x = torch.randn(tokens, hidden, device=dev).to(dtype)
                    nbytes = x.numel() * x.element_size()
                    iters = args.iters if nbytes < 1 << 24 else max(30, args.iters // 10)
                    spin = not args.no_spin
                    sock.send(msgpack.packb({"op": "run", "kind": kind, "max_bytes": nbytes,
                                             "iters": iters + 10, "spin": spin}))
                    sender, inbox = _setup(sock, kind, nbytes, dev)
                    times, parts = [], []
                    for i in range(iters + 10):
                        elapsed, y, part = _round_trip(sock, sender, inbox, x, dev, spin)
                        if i >= 10:
                            times.append(elapsed / 2)
                            parts.append(part)
                    assert torch.equal(y.to(x.device), x)
                    sender.close()
                    if inbox is not None:
                        inbox.close()
                    times.sort()
                    rows.append({"transport": kind, "devices": args.devices, "hidden": hidden,
                                 "tokens": tokens, "bytes": nbytes,
                                 "median_us": statistics.median(times) * 1e6,
                                 "p99_us": times[int(0.99 * (len(times) - 1))] * 1e6,
                                 "send_call_us": statistics.median(p[0] for p in parts) * 1e6,
                                 "final_sync_us": statistics.median(p[1] for p in parts) * 1e6})
        finally:
            sock.send(msgpack.packb({"op": "stop"}))
            peer.wait(30)
            sock.close(0)
            os.rmdir(where) if not os.listdir(where) else None
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nhop latency, one way (devices {args.devices}, {dtype}, "
          f"{'CurveZMQ on tcp, ' if args.curve else ''}"
          f"{'sleep on doorbell' if args.no_spin else 'spin-wait'} on rings), "
          f"host {os.uname().nodename}")
    print("(send call, final sync: medians of the first side's send() and of its closing stream "
          "sync, per round trip)")
    print(f"{'transport':<10} {'hidden':>6} {'tokens':>6} {'bytes':>10} {'median us':>10} "
          f"{'p99 us':>9} {'send call':>9} {'sync':>7}")
    for r in rows:
        print(f"{r['transport']:<10} {r['hidden']:>6} {r['tokens']:>6} {r['bytes']:>10} "
              f"{r['median_us']:>10.1f} {r['p99_us']:>9.1f} {r['send_call_us']:>9.1f} "
              f"{r['final_sync_us']:>7.1f}")


if __name__ == "__main__":
    main()
