"""Activation transports of one chain edge: `zmq`, `shm`, `cuda-ipc`, one interface.

The downstream shard owns the edge's memory (`offer`), the upstream shard maps it (`accept`).
Every transport sends a small notification on the zmq data socket; `zmq` carries the tensor bytes
in the same multipart message, `shm` and `cuda-ipc` put them in a ring the receiver owns.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from ipc.messages import ProtocolError
from ipc.shm import ShmRing
from ipc.sockets import send

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "cuda-ipc", "shm", "zmq")
RING_SLOTS = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# zmq frames are read-only buffers; activations are never written in place by the model.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def host_id() -> str:
    """Identifies this machine (and boot), so two ends can tell they share memory."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def tensor_from(buf: Any, act: dict[str, Any]) -> torch.Tensor:
    dtype = DTYPES.get(act.get("dtype"))
    shape = act.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0
                                                               for s in shape):
        raise ProtocolError(f"activation descriptor has a bad dtype/shape: {act!r}")
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes > len(buf):
        raise ProtocolError(f"activation of {nbytes} bytes does not fit its {len(buf)}-byte buffer")
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def resolve(requested: str, sender_host: str, sender_device: str, receiver_device: str) -> str:
    """Pick the transport for an edge (run on the receiving side, which sees both ends)."""
    same_host = sender_host == host_id()
    both_cuda = sender_device.startswith("cuda") and receiver_device.startswith("cuda")
    if requested == "auto":
        if same_host and both_cuda and cuda_peer_ok(sender_device, receiver_device):
            return "cuda-ipc"
        return "shm" if same_host else "zmq"
    if requested == "cuda-ipc":
        if not (same_host and both_cuda):
            raise ValueError(
                f"cuda-ipc needs both shards on CUDA devices of one host "
                f"(sender {sender_device} on {sender_host}, receiver {receiver_device})"
            )
        if not cuda_peer_ok(sender_device, receiver_device):
            raise ValueError(f"cuda-ipc: {sender_device} has no peer access to {receiver_device}")
    elif requested == "shm" and not same_host:
        raise ValueError("shm needs both shards on one host; use zmq across hosts")
    elif requested not in TRANSPORTS:
        raise ValueError(f"unknown transport {requested!r} (one of {', '.join(TRANSPORTS)})")
    return requested


def cuda_peer_ok(a: str, b: str) -> bool:
    ia, ib = torch.device(a).index or 0, torch.device(b).index or 0
    if ia == ib:
        return True
    try:
        return torch.cuda.can_device_access_peer(ib, ia)
    except Exception:  # noqa: BLE001 - no CUDA here, or an index out of range
        return False


class Sender(Protocol):
    kind: str

    def send(self, sock: zmq.Socket, header: dict[str, Any], t: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    kind: str

    def read(self, act: dict[str, Any], frames: list[zmq.Frame]) -> torch.Tensor: ...

    def release(self, act: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ---- zmq ---------------------------------------------------------------------------------------
class ZmqSender:
    kind = "zmq"

    def send(self, sock: zmq.Socket, header: dict[str, Any], t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        header["act"] = {"kind": "zmq", "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
        send(sock, header, [tensor_bytes(t)])

    def close(self) -> None:
        pass


class ZmqReceiver:
    kind = "zmq"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self, act: dict[str, Any], frames: list[zmq.Frame]) -> torch.Tensor:
        if len(frames) != 1:
            raise ProtocolError(f"zmq activation needs 1 payload frame, got {len(frames)}")
        return tensor_from(frames[0].buffer, act).to(self.device)

    def release(self, act: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


# ---- shm ---------------------------------------------------------------------------------------
class _RingChecks:
    ring: ShmRing
    expected_seq: int

    def _check(self, act: dict[str, Any], frames: list[zmq.Frame]) -> int:
        seq = act.get("seq")
        if frames:
            raise ProtocolError(f"{self.kind} activation carries no payload frames")
        if not isinstance(seq, int) or seq != self.expected_seq:
            raise ProtocolError(f"{self.kind}: expected message seq {self.expected_seq}, got {seq!r}")
        return seq % self.ring.slots

    def release(self, act: dict[str, Any]) -> None:
        self.ring.release(act["seq"])

    def reset_after_error(self, act: dict[str, Any] | None) -> None:
        """Consume the bad message so the ring and the sender stay in step."""
        seq = act.get("seq") if isinstance(act, dict) else None
        if isinstance(seq, int) and seq == self.expected_seq:
            self.expected_seq += 1
            self.ring.release(seq)


class ShmSender:
    kind = "shm"

    def __init__(self, ring: ShmRing) -> None:
        self.ring, self.seq = ring, 0

    def send(self, sock: zmq.Socket, header: dict[str, Any], t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > self.ring.slot_bytes:
            raise ValueError(f"activation of {nbytes} bytes exceeds the shm slot "
                             f"({self.ring.slot_bytes} bytes)")
        slot = self.ring.wait_free(self.seq)
        # a plain memcpy (numpy): no intra-op thread pool to wake for a host copy
        np.copyto(np.frombuffer(self.ring.slot(slot), dtype=np.uint8, count=nbytes),
                  t.view(torch.uint8).reshape(-1).numpy())
        header["act"] = {"kind": "shm", "seq": self.seq, "dtype": DTYPE_NAMES[t.dtype],
                         "shape": list(t.shape)}
        self.seq += 1
        send(sock, header)

    def close(self) -> None:
        self.ring.close()


class ShmReceiver(_RingChecks):
    kind = "shm"

    def __init__(self, ring: ShmRing, device: torch.device) -> None:
        self.ring, self.device, self.expected_seq = ring, device, 0

    def read(self, act: dict[str, Any], frames: list[zmq.Frame]) -> torch.Tensor:
        slot = self._check(act, frames)
        t = tensor_from(self.ring.slot(slot), act)
        self.expected_seq += 1
        return t.to(self.device)  # zero-copy on CPU: the slot is released after the step

    def close(self) -> None:
        self.ring.close()


# ---- cuda-ipc ----------------------------------------------------------------------------------
class CudaIpcSender:
    """Copies device-to-device into the receiver's ring (mapped by IPC handle), then syncs the
    copy before the notification leaves, so the receiver may read the slot at once."""

    kind = "cuda-ipc"

    def __init__(self, ring: ShmRing, buffer: torch.Tensor, slot_bytes: int) -> None:
        self.ring, self.buffer, self.slot_bytes, self.seq = ring, buffer, slot_bytes, 0

    def send(self, sock: zmq.Socket, header: dict[str, Any], t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"activation of {nbytes} bytes exceeds the cuda-ipc slot "
                             f"({self.slot_bytes} bytes)")
        slot = self.ring.wait_free(self.seq)
        dst = self.buffer[slot * self.slot_bytes: slot * self.slot_bytes + nbytes]
        dst.copy_(t.view(torch.uint8).reshape(-1), non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        torch.cuda.current_stream(dst.device).synchronize()
        header["act"] = {"kind": "cuda-ipc", "seq": self.seq, "dtype": DTYPE_NAMES[t.dtype],
                         "shape": list(t.shape)}
        self.seq += 1
        send(sock, header)

    def close(self) -> None:
        self.ring.close()
        self.buffer = None  # type: ignore[assignment]


class CudaIpcReceiver(_RingChecks):
    kind = "cuda-ipc"

    def __init__(self, ring: ShmRing, buffer: torch.Tensor, slot_bytes: int) -> None:
        self.ring, self.buffer, self.slot_bytes, self.expected_seq = ring, buffer, slot_bytes, 0

    def read(self, act: dict[str, Any], frames: list[zmq.Frame]) -> torch.Tensor:
        slot = self._check(act, frames)
        dtype = DTYPES.get(act.get("dtype"))
        shape = act.get("shape")
        if dtype is None or not isinstance(shape, list):
            raise ProtocolError(f"activation descriptor has a bad dtype/shape: {act!r}")
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.slot_bytes:
            raise ProtocolError(f"activation of {nbytes} bytes exceeds the slot")
        self.expected_seq += 1
        start = slot * self.slot_bytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        self.ring.close()
        self.buffer = None  # type: ignore[assignment]


def _share_cuda(buffer: torch.Tensor) -> dict[str, Any]:
    storage = buffer.untyped_storage()
    (dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync) = storage._share_cuda_()
    return {"device": int(dev), "handle": bytes(handle), "size": int(size), "offset": int(offset),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(ev_handle) if ev_handle else b"", "event_sync": bool(ev_sync)}


def _open_cuda(h: dict[str, Any]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"], h["handle"], h["size"], h["offset"], h["ref_handle"], h["ref_offset"],
        h["event_handle"] or None, h["event_sync"],
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage)


# ---- link setup ----------------------------------------------------------------------------------
def offer(kind: str, slot_bytes: int, device: torch.device) -> tuple[Receiver, dict | None]:
    """Receiver side: create this edge's memory; return the receiver and what the sender needs."""
    if kind == "zmq":
        return ZmqReceiver(device), None
    ring = ShmRing.create(RING_SLOTS, slot_bytes if kind == "shm" else 0)
    try:
        if kind == "shm":
            return ShmReceiver(ring, device), {"name": ring.name, "slots": RING_SLOTS,
                                               "slot_bytes": slot_bytes}
        buffer = torch.empty(RING_SLOTS * slot_bytes, dtype=torch.uint8, device=device)
        return CudaIpcReceiver(ring, buffer, slot_bytes), {
            "name": ring.name, "slots": RING_SLOTS, "slot_bytes": 0,
            "cuda": _share_cuda(buffer), "cuda_slot_bytes": slot_bytes,
        }
    except BaseException:
        ring.close()
        raise


def accept(kind: str, ring: dict | None) -> Sender:
    """Sender side: map what the receiver offered."""
    if kind == "zmq":
        return ZmqSender()
    if not isinstance(ring, dict):
        raise ProtocolError(f"{kind} link reply carries no ring description")
    shm = ShmRing.attach(str(ring["name"]), int(ring["slots"]), int(ring["slot_bytes"]))
    if kind == "shm":
        return ShmSender(shm)
    return CudaIpcSender(shm, _open_cuda(ring["cuda"]), int(ring["cuda_slot_bytes"]))


def describe() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": host_id()}
