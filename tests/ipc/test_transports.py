"""Each CPU transport moves tensors exactly; the shm ring enforces flow control and mode 0600."""

from __future__ import annotations

import stat
import threading

import pytest
import torch
import zmq

from ipc import transport
from ipc.messages import ProtocolError, message
from ipc.shm import SHM_DIR, ShmRing
from ipc.sockets import recv


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://t{id(a)}"
    b.bind(addr)
    a.connect(addr)
    yield a, b
    a.close(0)
    b.close(0)


@pytest.mark.parametrize("kind", ["zmq", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip(pair, kind, dtype):
    a, b = pair
    recv_side, ring = transport.offer(kind, 8 * 64 * 4, torch.device("cpu"))
    send_side = transport.accept(kind, ring)
    if ring:
        recv_side.ring.unlink()
        assert not (SHM_DIR / ring["name"]).exists()  # name gone, memory still mapped
    for i in range(10):  # more messages than ring slots
        t = torch.randn(1 + i % 8, 64).to(dtype)
        send_side.send(a, message("step", sid=i, slot=0, pos=0, n=t.shape[0], sample=None,
                                  logits=False, act=None), t)
        _, msg, frames, err = recv(b)
        assert err is None
        got = recv_side.read(msg["act"], frames)
        assert got.dtype == dtype and torch.equal(got, t)
        recv_side.release(msg["act"])
    send_side.close()
    recv_side.close()


def test_shm_is_private_and_flow_controlled():
    ring = ShmRing.create(2, 16)
    try:
        mode = stat.S_IMODE((SHM_DIR / ring.name).stat().st_mode)
        assert mode == 0o600
        other = ShmRing.attach(ring.name, 2, 16)
        assert other.wait_free(0) == 0 and other.wait_free(1) == 1
        done = threading.Event()

        def writer():
            other.wait_free(2)  # blocks until the receiver releases message 0
            done.set()

        th = threading.Thread(target=writer)
        th.start()
        assert not done.wait(0.2)
        ring.release(0)
        assert done.wait(2)
        th.join()
        with pytest.raises(ValueError):
            ShmRing.attach(ring.name, 3, 16)  # wrong geometry is refused
        with pytest.raises(ValueError):
            ShmRing.attach("../etc/passwd", 1, 1)
        other.close()
    finally:
        ring.unlink()
        ring.close()


def test_bad_ring_message_is_consumed(pair):
    a, b = pair
    r, ring = transport.offer("shm", 256, torch.device("cpu"))
    s = transport.accept("shm", ring)
    r.ring.unlink()
    s.send(a, message("step", sid=0, slot=0, pos=0, n=1, sample=None, logits=False, act=None),
           torch.ones(1, 4))
    _, msg, frames, _ = recv(b)
    bad = dict(msg["act"], dtype="complex128")
    with pytest.raises(ProtocolError):
        r.read(bad, frames)
    r.reset_after_error(msg["act"])
    # the next message lines up again
    s.send(a, message("step", sid=1, slot=0, pos=0, n=1, sample=None, logits=False, act=None),
           torch.full((1, 4), 2.0))
    _, msg, frames, _ = recv(b)
    assert torch.equal(r.read(msg["act"], frames), torch.full((1, 4), 2.0))
    with pytest.raises(ProtocolError, match="seq"):
        r.read(msg["act"], frames)  # a replayed notification is refused
    s.close()
    r.close()


def test_resolve():
    h = transport.host_id()
    assert transport.resolve("auto", h, "cpu", "cpu") == "shm"
    assert transport.resolve("auto", "elsewhere/1", "cpu", "cpu") == "zmq"
    with pytest.raises(ValueError, match="one host"):
        transport.resolve("shm", "elsewhere/1", "cpu", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        transport.resolve("cuda-ipc", h, "cpu", "cpu")
