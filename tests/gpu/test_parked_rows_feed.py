"""Parked feature rows reach the draft as they were parked, on every draft-feed transport.

A shard parks rows in one buffer on its device (`shards.parked_rows`) and writes it again at the
next `add` after a `take`: each transport must have copied the taken rows out first (zmq: a
blocking copy to the host; shm: that copy and a memmove into the ring; cuda-ipc: a device copy
queued on the current stream, before the next `add`'s write). Here rows of several contexts
and steps are parked on cuda:0, taken, sent as the shard sends them (`feature_messages`), and
new rows are parked at once over them; what the receiver got is then compared with copies
made when the rows were parked. The GPU runs behind the host all along (a spin kernel before
each round's rows), and the cuda-ipc receiver, another process as the draft is, is slow to read
its slots (a spin before each read), so the sender's copies into reused slots wait on the GPU.
Run on a CUDA machine: `python -m pytest -m gpu tests/gpu/test_parked_rows_feed.py`."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layersplit.ipc import transport  # noqa: E402
from layersplit.ipc.sockets import recv  # noqa: E402
from layersplit.shards.parked_rows import ParkedRows, feature_messages  # noqa: E402

pytestmark = [pytest.mark.gpu,  # (the shard parks its rows on a CUDA device)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, HIDDEN = [1, 4, 7], 256
WIDTH = len(LAYERS) * HIDDEN
PIECE = 16  # rows a feed message holds (a 21-row run goes in two messages)
ROUNDS = 3
DEVICE = "cuda:0"  # where the shard parks its rows
SPIN_CYCLES = 2_000_000  # about a millisecond of one SM spinning
_ADDRESSES = itertools.count()


def _park(parked: ParkedRows, r: int, pos: dict[int, int],
          kept: dict[tuple[int, int, int], torch.Tensor]) -> None:
    """Round `r`'s rows, kept as parked (`kept[round, context, position]`: copies made on the
    device, in stream order, so that the host never waits for the GPU): context 0 alone for a
    20-row step and a decode step (one run in one piece: views of the buffer itself), then
    contexts 1-3 side by side for 5 steps, context 3 with 3 rows a step (runs of several
    pieces: gathered). The GPU is kept behind the host (a spin first)."""
    torch.cuda._sleep(SPIN_CYCLES)
    steps = [[(0, 20)], [(0, 1)]] + [[(1, 1), (2, 1), (3, 3)]] * 5
    for k, segs in enumerate(steps):
        for context, n in segs:
            parts = [torch.randn(n, HIDDEN, device=DEVICE).to(torch.bfloat16) for _ in LAYERS]
            rows = torch.cat(parts, dim=-1)  # (a copy)
            for i in range(n):
                kept[r, context, pos[context] + i] = rows[i]
            parked.add(r * 100 + k, context, pos[context], parts)
            pos[context] += n


def _send(parked: ParkedRows, sender: transport.Sender) -> int:
    """Take every parked row and send it; the number of messages sent."""
    sent = 0
    for header, rows in feature_messages(parked.take(), PIECE, LAYERS, last=True):
        sender.send(header, rows)
        sent += 1
    return sent


def _check(got: list[tuple[dict, torch.Tensor]], kept: dict, r: int) -> None:
    """The messages of round `r` carry every row parked in it once, as it was parked."""
    seen = []
    for header, rows in got:
        assert header["sid"] // 100 == r and rows.shape == (header["n"], WIDTH)
        want = torch.stack([kept[r, header["slot"], header["pos"] + i]
                            for i in range(header["n"])]).cpu()
        assert torch.equal(rows, want), (header, "rows changed after they were parked")
        seen += [(r, header["slot"], header["pos"] + i) for i in range(header["n"])]
    assert sorted(seen) == sorted(k for k in kept if k[0] == r)
    assert got[-1][0]["last"] and not any(h["last"] for h, _ in got[:-1])


def _rounds(sender: transport.Sender, receive) -> dict:
    """Park, take and send a round, park the next over it at once, then read what came (checked
    here unless `receive` returns None); the rows kept."""
    parked, pos, kept = ParkedRows(), dict.fromkeys(range(4), 0), {}
    _park(parked, 0, pos, kept)
    buffer = parked.buffer.data_ptr()
    for r in range(ROUNDS):
        sent = _send(parked, sender)
        _park(parked, r + 1, pos, kept)  # (over the rows just sent)
        assert parked.buffer.data_ptr() == buffer  # (one buffer, written again)
        got = receive(sent)
        if got is not None:
            _check(got, kept, r)
    return kept


def test_parked_rows_reach_the_draft_as_parked_over_zmq():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"inproc://parked{next(_ADDRESSES)}"
    b.bind(address)
    a.connect(address)

    def receive(n):
        got = []
        for _ in range(n):
            assert b.poll(10_000)
            _, msg, frames, err = recv(b)
            assert err is None
            got.append((msg, transport.zmq_tensor(msg, frames).clone()))
        return got

    try:
        _rounds(transport.accept("zmq", None, None, sock=a), receive)
    finally:
        a.close(0)
        b.close(0)


def test_parked_rows_reach_the_draft_as_parked_over_an_shm_ring(monkeypatch):
    """A ring with room for every message of a round: they wait in it unread until the next
    rows are parked."""
    monkeypatch.setattr(transport, "RING_SLOTS", 64)
    inbox, desc = transport.offer("shm", PIECE * WIDTH * 2, torch.device("cpu"))
    sender = transport.accept("shm", desc, None)

    def receive(n):
        got = []
        for _ in range(n):
            msg, rows, seq = inbox.poll()
            got.append((msg, rows.clone()))
            inbox.release(seq)
        assert inbox.poll() is None
        return got

    try:
        _rounds(sender, receive)
    finally:
        sender.close()
        inbox.close()


def test_parked_rows_reach_the_draft_as_parked_over_a_cuda_ipc_ring(tmp_path):
    """The receiver is another process (CUDA IPC maps no memory into the process that made it),
    on cuda:1 where there is one; it reads each message as it comes, slowly, and sends every
    row it got back at the end."""
    recv_dev = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    sock = zmq.Context.instance().socket(zmq.PAIR)
    address = f"ipc://{tmp_path}/feed.sock"
    sock.bind(address)
    child = subprocess.Popen([sys.executable, __file__, address, recv_dev])
    sender = None
    try:
        assert sock.poll(120_000), "the receiving process sent no ring"
        sender = transport.accept("cuda-ipc", msgpack.unpackb(sock.recv(), raw=False), None)
        counts = []
        kept = _rounds(sender, counts.append)
        sock.send(msgpack.packb(sum(counts)))
        got = []
        for _ in range(sum(counts)):
            assert sock.poll(120_000), "the receiving process sent back no rows"
            header, data = sock.recv_multipart()
            header = msgpack.unpackb(header, raw=False)
            rows = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
            got.append((header, rows.view(header["n"], WIDTH)))
        sender.close()
        sender = None
        sock.send(b"done")
        assert child.wait(60) == 0
        start = 0
        for r, n in enumerate(counts):
            _check(got[start:start + n], kept, r)
            start += n
    finally:
        if sender is not None:
            sender.close()
        if child.poll() is None:
            child.kill()
        sock.close(0)


def _receiver(address: str, device: str) -> None:
    """The draft's end of a cuda-ipc feed: offer a device ring, read each message as it comes
    (a spin on the stream before each read: the slot is released late on the GPU), then send
    back every row read."""
    torch.cuda.set_device(device)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    inbox, desc = transport.offer("cuda-ipc", PIECE * WIDTH * 2, torch.device(device))
    sock.send(msgpack.packb(desc, use_bin_type=True))
    got, total = [], None
    while total is None or len(got) < total:
        if total is None and sock.poll(0):
            total = msgpack.unpackb(sock.recv())
        polled = inbox.poll()
        if polled is None:
            continue
        msg, rows, seq = polled
        torch.cuda._sleep(SPIN_CYCLES)
        got.append((msg, rows.clone()))
        inbox.release(seq)
    for msg, rows in got:
        header = {k: msg[k] for k in ("sid", "slot", "pos", "n", "last")}
        sock.send_multipart([msgpack.packb(header, use_bin_type=True),
                             rows.cpu().view(torch.int16).numpy().tobytes()])
    assert sock.recv() == b"done"
    inbox.close()
    sock.close(0)


if __name__ == "__main__":
    _receiver(sys.argv[1], sys.argv[2])
