"""The cuda-ipc edge orders two processes' streams with IPC events, and no host waits
(`ipc.cuda_handoff`). Run on a CUDA machine: `python -m pytest -m gpu`.

A second process sends numbered activations into this process's device ring, then a message
with a malformed ready event and one with a malformed activation descriptor. In one phase its
GPU is slow to produce them (a spin kernel before each fill: a receiver that read on publish
would see old rows); in the other this process is slow to read them (a spin kernel before each
copy out: a sender that wrote on credit would overwrite a slot still unread). Every row must
arrive as sent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layersplit.ipc import (
    cuda_handoff,  # noqa: E402
    transport,  # noqa: E402
)
from layersplit.ipc.messages import ProtocolError, encode, message, segment  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS, HIDDEN, COUNT = 64, 1024, 24
SPIN_CYCLES = 2_000_000  # about a millisecond of one SM spinning


def _step() -> dict:
    return message("step", sid=0, seqs=[segment(0, 0, ROWS)], act=None)


def _sender(address: str, device: str) -> None:
    torch.cuda.set_device(device)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    desc = msgpack.unpackb(sock.recv(), raw=False)
    sender = transport.accept("cuda-ipc", desc, None)
    for phase in ("slow-sender", "slow-receiver"):
        for i in range(COUNT):
            if phase == "slow-sender":
                torch.cuda._sleep(SPIN_CYCLES)
            x = torch.full((ROWS, HIDDEN), float(i), dtype=torch.bfloat16, device=device)
            sender.send(_step(), x)
    write = sender.device.write
    sender.device.write = lambda slot, src, nbytes: "not an event"  # a malformed header
    sender.send(_step(), torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16, device=device))
    sender.device.write = write
    slot = sender.ring.wait_free(sender.seq)  # a malformed activation descriptor
    sender.ring.write_header(slot, encode({**_step(), "seq": sender.seq,
                                           "act": {"dtype": ["bfloat16"], "shape": [[ROWS]]}}))
    sender.ring.publish(sender.seq)
    sender.seq += 1
    assert sock.recv() == b"done"
    sender.close()


def _take(inbox: transport.RingInbox):
    while not inbox.ready():
        pass
    return inbox.poll()


@pytest.mark.parametrize("events", [True, False], ids=["ipc-events", "host-sync-fallback"])
def test_cuda_ipc_hop_is_ordered_on_the_gpus(tmp_path, monkeypatch, events):
    """With IPC events (the sender publishes before its copy has run), and without them (a
    receiver on a platform with none: the sender synchronizes its copies, the receiver its
    reads)."""
    monkeypatch.setattr(cuda_handoff, "IPC_EVENTS_OFF", not events)
    n = torch.cuda.device_count()
    recv_dev, send_dev = ("cuda:1", "cuda:0") if n >= 2 else ("cuda:0", "cuda:0")
    with torch.cuda.device(recv_dev):  # (the spin kernels run on the current device)
        _receive(recv_dev, send_dev, tmp_path, events)


def _receive(recv_dev: str, send_dev: str, tmp_path, events: bool) -> None:
    inbox, desc = transport.offer("cuda-ipc", ROWS * HIDDEN * 2, torch.device(recv_dev),
                                  header_only_payload=0)
    assert inbox is not None and (desc["consumed"] is not None) == events
    sock = zmq.Context.instance().socket(zmq.PAIR)
    address = f"ipc://{tmp_path}/handoff.sock"
    sock.bind(address)
    child = subprocess.Popen([sys.executable, __file__, address, send_dev])
    try:
        sock.send(msgpack.packb(desc, use_bin_type=True))
        for phase in ("slow-sender", "slow-receiver"):
            got = []
            for _ in range(COUNT):
                msg, y, seq = _take(inbox)
                assert (msg["ev"] is not None) == events  # ordered by an event, or the host
                if phase == "slow-receiver":
                    torch.cuda._sleep(SPIN_CYCLES)
                got.append(y.clone())
                inbox.release(seq)
            torch.cuda.synchronize()
            values = [float(g.float().min()) for g in got]
            assert values == [float(i) for i in range(COUNT)], phase
            assert all(float(g.float().max()) == v for g, v in zip(got, values)), phase
        with pytest.raises(ProtocolError, match="bad ready event"):
            _take(inbox)
        with pytest.raises(ProtocolError, match="bad dtype/shape"):
            _take(inbox)
        assert not inbox.ready()  # each bad message was consumed; the ring is in step
        sock.send(b"done")
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
        sock.close(0)
        inbox.close()


if __name__ == "__main__":
    _sender(sys.argv[1], sys.argv[2])
