"""Each CPU transport moves tensors exactly; the shm ring enforces flow control, mode 0600,
spin/sleep signalling, and consumes a malformed message without losing step. The coordinator's
side (numpy arrays, no torch) moves token ids and results exactly, and refuses by name a payload
it cannot hold or the wire does not carry."""

from __future__ import annotations

import itertools
import stat
import threading
import time

import numpy as np
import pytest
import torch
import zmq
from layersplit.ipc import transport
from layersplit.ipc.messages import ProtocolError, encode, message, segment
from layersplit.ipc.shm import SHM_DIR, ShmRing
from layersplit.ipc.sockets import recv, ring_doorbell

_ADDRESSES = itertools.count()


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://t{next(_ADDRESSES)}"  # (not id(a): a closed socket's name lingers)
    b.bind(addr)
    a.connect(addr)
    yield a, b
    a.close(0)
    b.close(0)


def _step(i, n):
    return message("step", sid=i, seqs=[segment(0, 0, n)], act=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_zmq_roundtrip(pair, dtype):
    a, b = pair
    s = transport.accept("zmq", None, None, sock=a)
    t = (torch.randn(5, 64) * 100).to(dtype)
    s.send(_step(0, 5), t)
    _, msg, frames, err = recv(b)
    assert err is None and torch.equal(transport.zmq_tensor(msg, frames), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_roundtrip_and_flow_control(dtype):
    inbox, desc = transport.offer("shm", 8 * 64 * 4, torch.device("cpu"))
    rings = 0
    bells = []
    sender = transport.accept("shm", desc, lambda: bells.append(1))
    assert not (SHM_DIR / desc["ring"]["name"]).exists()  # name gone once both ends map it
    for i in range(10):  # more messages than ring slots
        t = torch.randn(1 + i % 8, 64).to(dtype)
        sender.send(_step(i, t.shape[0]), t)
        msg, got, seq = inbox.poll()
        assert msg["sid"] == i and got.dtype == dtype and torch.equal(got, t)
        inbox.release(seq)
        rings += 1
    assert inbox.poll() is None and bells == []  # an awake receiver needs no doorbell
    inbox.sleep(True)
    sender.send(_step(10, 1), torch.ones(1, 64))
    assert bells == [1]
    sender.close()
    inbox.close()


def test_a_sender_without_a_wait_finds_a_full_ring_at_once():
    """A sender whose timeout is 0 (the draft's proposals to the first shard, which may itself
    wait for the draft to take feature rows) learns of a full ring at once, and sends on once
    the receiver has taken a message."""
    inbox, desc = transport.offer("shm", 64, torch.device("cpu"))
    sender = transport.accept("shm", desc, None)
    sender.timeout_s = 0.0
    try:
        for i in range(transport.RING_SLOTS):
            sender.send(_step(i, 1), None)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="receiver stalled"):
            sender.send(_step(99, 1), None)
        assert time.monotonic() - t0 < 0.05
        msg, _, seq = inbox.poll()
        inbox.release(seq)
        sender.send(_step(4, 1), None)
        got = []
        while (m := inbox.poll()) is not None:
            got.append(m[0]["sid"])
            inbox.release(m[2])
        assert msg["sid"] == 0 and got == [1, 2, 3, 4]
    finally:
        sender.close()
        inbox.close()


def test_shm_is_private_and_blocks_a_fast_sender():
    ring = ShmRing.create(2, 16)
    try:
        assert stat.S_IMODE((SHM_DIR / ring.name).stat().st_mode) == 0o600
        other = ShmRing.attach(ring.describe())
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
        other.close()
        with pytest.raises(ValueError):
            ShmRing.attach({"name": "../etc/passwd", "slots": 1, "payload_bytes": 1})
        with pytest.raises(ValueError):
            ShmRing.attach({"name": ring.name})
    finally:
        ring.close()


def test_wrong_geometry_is_refused():
    ring = ShmRing.create(2, 16)
    try:
        with pytest.raises(ValueError, match="expected"):
            ShmRing.attach({**ring.describe(), "slots": 3})
    finally:
        ring.close()


def test_bad_ring_message_is_consumed():
    inbox, desc = transport.offer("shm", 256, torch.device("cpu"))
    sender = transport.accept("shm", desc, None)
    ring = sender.ring
    # a garbage header in the next slot, published
    ring.write_header(0, b"\xc1 garbage")
    ring.publish(0)
    with pytest.raises(ProtocolError):
        inbox.poll()
    # a well-formed header that claims a tensor larger than the slot
    ring.write_header(1, encode({**_step(1, 1), "seq": 1,
                                 "act": {"dtype": "float32", "shape": [1000, 1000]}}))
    ring.publish(1)
    with pytest.raises(ProtocolError, match="does not fit"):
        inbox.poll()
    # descriptors of the wrong types (an unhashable dtype, nested shapes)
    for seq, act in ((2, {"dtype": ["float32"], "shape": [1, 4]}),
                     (3, {"dtype": "float32", "shape": [[1], 4]})):
        ring.write_header(seq % ring.slots, encode({**_step(seq, 1), "seq": seq, "act": act}))
        ring.publish(seq)
        with pytest.raises(ProtocolError, match="bad dtype/shape"):
            inbox.poll()
    assert ring.released == 4  # all consumed: the sender is not blocked
    _goes_on(sender, inbox, seq=4, sid=2)


def test_resolve():
    h = transport.host_id()
    assert transport.resolve("auto", h, "cpu", "cpu") == "shm"
    assert transport.resolve("auto", "elsewhere/1", "cpu", "cpu") == "zmq"
    with pytest.raises(ValueError, match="one host"):
        transport.resolve("shm", "elsewhere/1", "cpu", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        transport.resolve("cuda-ipc", h, "cpu", "cpu")


def test_cuda_ipc_link_reply_with_bad_event_handles_is_refused():
    """Checked before any CUDA call, and the mapped ring is let go."""
    for bad in ("nope", [b"x"], ["h"] * transport.RING_SLOTS):
        inbox, desc = transport.offer("shm", 64, torch.device("cpu"))  # (a ring maps once)
        try:
            with pytest.raises(ProtocolError, match="consumed-event handles"):
                transport.accept("cuda-ipc", {**desc, "consumed": bad}, None)
        finally:
            inbox.close()


@pytest.mark.timeout(30)
def test_a_doorbell_never_blocks(tmp_path):
    """A ring's doorbell is a `wake` message that never blocks its sender: with no reader
    connected, or a reader that has not read its queue up to the high-water mark, the wake is
    dropped (one already waits, or nobody needs it), where a plain send would wait for ever."""
    ctx = zmq.Context.instance()
    lonely = ctx.socket(zmq.DEALER)  # connected to an address nobody binds: no pipe
    lonely.connect(f"ipc://{tmp_path}/nobody.sock")
    ring_doorbell(lonely)
    reader = ctx.socket(zmq.ROUTER)
    reader.bind(f"ipc://{tmp_path}/reader.sock")
    writer = ctx.socket(zmq.DEALER)
    writer.setsockopt(zmq.SNDHWM, 2)
    reader.setsockopt(zmq.RCVHWM, 2)
    writer.connect(f"ipc://{tmp_path}/reader.sock")
    for _ in range(100):  # the reader reads none: the high-water mark is reached
        ring_doorbell(writer)
    got = 0
    while reader.poll(200):
        _, msg, _, err = recv(reader, routed=True)
        assert err is None and msg["type"] == "wake"
        got += 1
    assert 1 <= got < 100
    for s in (lonely, reader, writer):
        s.close(0)


def test_a_ring_view_kept_for_a_shape_takes_no_lookalike_descriptor():
    """The receiver keeps a view per slot and shape: a later descriptor that only compares
    equal to one (a bool or float dimension, True as seq 1) is still refused, and consumed."""
    inbox, desc = transport.offer("shm", 256, torch.device("cpu"))
    sender = transport.accept("shm", desc, None)
    ring = sender.ring
    ring.write_header(0, encode({**_step(0, 1), "seq": 0, "act": None}))
    ring.publish(0)
    inbox.release(inbox.poll()[2])
    ring.write_header(1, encode({**_step(1, 1), "seq": True, "act": None}))
    ring.publish(1)
    with pytest.raises(ProtocolError, match="seq True"):
        inbox.poll()
    sender.seq = 2
    for i in range(2, 6):  # a view kept for every slot
        sender.send(_step(i, 1), torch.full((1, 4), float(i)))
        inbox.release(inbox.poll()[2])
    for seq, shape in ((6, [True, 4]), (7, [1.0, 4]), (8, [1, -4])):
        ring.write_header(seq % ring.slots, encode({**_step(seq, 1), "seq": seq,
                                                    "act": {"dtype": "float32", "shape": shape}}))
        ring.publish(seq)
        with pytest.raises(ProtocolError, match="bad dtype/shape"):
            inbox.poll()
    assert ring.released == 9
    _goes_on(sender, inbox, seq=9, sid=9)


def _goes_on(sender, inbox, seq: int, sid: int) -> None:
    """After the refused messages, the sender's next one (`seq`) arrives whole; both closed."""
    sender.seq = seq
    sender.send(_step(sid, 1), torch.full((1, 4), float(sid)))
    msg, t, _ = inbox.poll()
    assert msg["sid"] == sid and torch.equal(t, torch.full((1, 4), float(sid)))
    sender.close()
    inbox.close()


# ---- the coordinator's side: host numpy arrays, no torch ---------------------------------------
def _ring(payload_bytes, device):
    inbox, desc = transport.offer("shm", payload_bytes, device)
    return inbox, transport.accept("shm", desc, None)


def _result(i):
    out = {"token": None, "accepted": 0, "logits": True, "path": None, "asked": None, "lp": None,
           "plp": None}
    return message("result", sid=i, outs=[out], act=None)


def _ids(n):
    return np.arange(n, dtype=np.int64) * 7_919 + (1 << 40)  # (above int32: all 8 bytes)


@pytest.mark.parametrize("n", [5, 0])
def test_host_arrays_roundtrip_through_an_shm_ring(n):
    """Token ids the coordinator sends (a numpy int64 array) reach a shard's inbox and a numpy
    inbox exactly; a shard's float32 results reach the coordinator's numpy inbox exactly (as
    numpy arrays, of the sent dtype and shape: 0 rows too)."""
    ids = _ids(n)
    logits = torch.randn(n, 33) * 1e3
    steps, to_shard = _ring(64 * 8, torch.device("cpu"))
    ids_inbox, to_ids = _ring(64 * 8, None)
    results, to_results = _ring(8 * 33 * 4, None)
    try:
        for i in range(3):  # (a view kept for a slot and shape is read again)
            to_shard.send(_step(i, n), ids)
            msg, got, seq = steps.poll()
            assert msg["sid"] == i and got.dtype == torch.int64 and got.shape == (n,)
            assert np.array_equal(got.numpy(), ids)
            steps.release(seq)
            to_ids.send(_step(i, n), ids)
            msg, got, seq = ids_inbox.poll()
            assert type(got) is np.ndarray and got.dtype == np.int64 and got.shape == (n,)
            assert np.array_equal(got, ids)
            ids_inbox.release(seq)
            to_results.send(_result(i), logits + i)
            msg, got, seq = results.poll()
            assert type(got) is np.ndarray and got.dtype == np.float32 and got.shape == (n, 33)
            assert np.array_equal(got, (logits + i).numpy())
            results.release(seq)
    finally:
        for end in (to_shard, steps, to_ids, ids_inbox, to_results, results):
            end.close()


@pytest.mark.parametrize("n", [5, 0])
def test_host_arrays_roundtrip_over_zmq(pair, n):
    a, b = pair
    ids, logits = _ids(n), torch.randn(n, 33) * 1e3
    s = transport.accept("zmq", None, None, sock=a)
    s.send(_step(0, n), ids)
    _, msg, frames, err = recv(b)
    assert err is None
    for got in (transport.zmq_tensor(msg, frames).numpy(), transport.zmq_array(msg, frames)):
        assert got.dtype == np.int64 and got.shape == (n,) and np.array_equal(got, ids)
    s.send(_result(0), logits)
    _, msg, frames, err = recv(b)
    got = transport.zmq_array(msg, frames)
    assert err is None and type(got) is np.ndarray and got.dtype == np.float32
    assert got.shape == (n, 33) and np.array_equal(got, logits.numpy())


def test_a_bfloat16_payload_into_a_host_array_is_refused(pair):
    """numpy has no bfloat16: the coordinator's inbox refuses one by name (and consumes it)."""
    results, sender = _ring(4 * 8 * 4, None)
    try:
        sender.send(_result(0), torch.ones(4, 8, dtype=torch.bfloat16))
        with pytest.raises(ProtocolError, match="bfloat16"):
            results.poll()
        assert sender.ring.released == 1 and not results.ready()
        sender.send(_result(1), torch.ones(4, 8))
        msg, got, _ = results.poll()
        assert msg["sid"] == 1 and np.array_equal(got, np.ones((4, 8), np.float32))
    finally:
        sender.close()
        results.close()
    a, b = pair
    transport.accept("zmq", None, None, sock=a).send(
        _result(0), torch.ones(4, 8, dtype=torch.bfloat16))
    _, msg, frames, err = recv(b)
    assert err is None
    with pytest.raises(ProtocolError, match="bfloat16"):
        transport.zmq_array(msg, frames)


@pytest.mark.parametrize("bad", [np.arange(4, dtype=np.int32), np.ones(4, np.float64),
                                 torch.arange(4, dtype=torch.int32)],
                         ids=["np-int32", "np-float64", "torch-int32"])
def test_a_dtype_the_wire_does_not_carry_is_refused_before_publishing(pair, bad):
    """Refused by name before the ring sees anything: nothing published, the next message goes
    through the same slot; over zmq nothing is sent."""
    name = str(bad.dtype).removeprefix("torch.")
    inbox, sender = _ring(64, None)
    try:
        with pytest.raises(KeyError, match=name):
            sender.send(_step(0, 4), bad)
        assert sender.ring.published == 0 and sender.seq == 0 and not inbox.ready()
        sender.send(_step(1, 4), _ids(4))
        msg, got, seq = inbox.poll()
        assert msg["sid"] == 1 and seq == 0 and np.array_equal(got, _ids(4))
    finally:
        sender.close()
        inbox.close()
    a, b = pair
    with pytest.raises(KeyError, match=name):
        transport.accept("zmq", None, None, sock=a).send(_step(0, 4), bad)
    assert not b.poll(0)
