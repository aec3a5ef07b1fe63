"""Moving step messages and their tensors between processes: `zmq`, `shm`, `cuda-ipc`.

One interface: a `Sender` posts (header, tensor); a ring `Inbox` is polled for (header, tensor).

- `zmq`: header and tensor bytes as one multipart message on a socket (any host).
- `shm`: header and payload in a shared-memory ring (`ipc.shm.ShmRing`), waited on by spinning.
- `cuda-ipc`: header in a shared-memory ring, payload in a device ring the receiver shares by
  CUDA IPC handle (torch's `_share_cuda_`, HIP IPC on ROCm); the sender copies device to device
  and CUDA IPC events order the two processes' streams, not host waits (`ipc.cuda_handoff`).

The receiving side owns the memory (`offer`), the sending side maps it (`accept`). The same ring
carries token ids from the coordinator to shard 0 and results from the last shard back.

The coordinator sends and receives host numpy arrays (`offer` with no device, `zmq_array`) and
never imports torch: torch is imported by the functions that make or read tensors, which run in
the shards (and the draft).
"""

from __future__ import annotations

import ctypes
import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import zmq
from layersplit.ipc.hosts import host_id
from layersplit.ipc.messages import ProtocolError, decode, encoder
from layersplit.ipc.shm import ShmRing
from layersplit.ipc.sockets import send

if TYPE_CHECKING:
    import torch
    from layersplit.ipc.cuda_handoff import SlotReader, SlotWriter

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "cuda-ipc", "shm", "zmq")
RING_SLOTS = 4
# the payload dtypes (torch's, and numpy's but bfloat16, of the same names) and their bytes
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}

# zmq frames are read-only buffers; received tensors are never written in place.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    import torch

    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


_INT = frozenset((int,))


def _act(act: Any) -> tuple[str, list[int]]:
    """The dtype name and shape of an activation descriptor, checked."""
    if not isinstance(act, dict):
        raise ProtocolError(f"activation descriptor must be a map, got {type(act).__name__}")
    name, shape = act.get("dtype"), act.get("shape")
    # (bool is not int here: `type`, not isinstance)
    if not isinstance(name, str) or name not in ITEMSIZE or type(shape) is not list or \
            not _INT.issuperset(map(type, shape)) or (shape and min(shape) < 0):
        raise ProtocolError(f"activation descriptor has a bad dtype/shape: {act!r}")
    return name, shape


def _fitted(buf: Any, act: dict[str, Any]) -> tuple[str, list[int], int]:
    """`act`'s dtype name, shape and element count; refuse one that does not fit `buf`."""
    name, shape = _act(act)
    numel = math.prod(shape)
    if numel * ITEMSIZE[name] > len(buf):
        raise ProtocolError(f"activation of {numel * ITEMSIZE[name]} bytes does not fit its "
                            f"{len(buf)}-byte buffer")
    return name, shape, numel


def tensor_from(buf: Any, act: dict[str, Any]) -> torch.Tensor:
    """View `buf` as the tensor `act` describes (dtype, shape); refuse one that does not fit."""
    import torch

    name, shape, numel = _fitted(buf, act)
    dtype = getattr(torch, name)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def array_from(buf: Any, act: dict[str, Any]) -> np.ndarray:
    """`tensor_from` for the coordinator: a numpy view (numpy has no bfloat16: refused)."""
    name, shape, numel = _fitted(buf, act)
    if name == "bfloat16":
        raise ProtocolError("a bfloat16 payload for a host array (float32 expected)")
    return np.frombuffer(buf, dtype=name, count=numel).reshape(shape)


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch or numpy dtype (KeyError for one the wire does not carry)."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise KeyError(f"dtype {dtype} is not carried between processes (these are: "
                       f"{', '.join(ITEMSIZE)})")
    return name


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
    import torch

    ia, ib = torch.device(a).index or 0, torch.device(b).index or 0
    if ia == ib:
        return True
    try:
        return torch.cuda.can_device_access_peer(ib, ia)
    except Exception:  # noqa: BLE001 - no CUDA here, or an index out of range
        return False


class Sender(Protocol):
    kind: str

    def send(self, header: dict[str, Any], t: torch.Tensor | np.ndarray | None) -> None: ...

    def close(self) -> None: ...


# ---- zmq ---------------------------------------------------------------------------------------
class ZmqSender:
    """Header and tensor bytes as one multipart message (`route` for a ROUTER socket). The
    header's `act` of a shape sent before is reused, and the tensor goes as a numpy view of its
    memory (no byte view made of it per message), the header packed by a packer kept for it."""

    kind = "zmq"

    def __init__(self, sock: zmq.Socket, route: bytes | None = None) -> None:
        self.sock, self.route = sock, route
        self._acts = Acts()
        self._encode = encoder()  # (one thread uses it: the one that may use the socket)

    def send(self, header: dict[str, Any], t: torch.Tensor | np.ndarray | None) -> None:
        """`t`: a tensor, or a host numpy array (the coordinator's)."""
        frames: tuple[Any, ...] = ()
        if type(t) is np.ndarray:
            t = np.ascontiguousarray(t)
            header["act"] = self._acts.of(t)[0]
            frames = (t,)
        elif t is not None:
            import torch

            if t.requires_grad:
                t = t.detach()
            if not t.is_cpu:
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            header["act"] = self._acts.of(t)[0]
            # (numpy has no bfloat16: its bits go as int16)
            frames = (t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy(),)
        send(self.sock, header, frames, route=self.route, pack=self._encode)

    def close(self) -> None:
        pass


class Acts:
    """The header `act` ({dtype, shape}) of each dtype and shape a sender has sent, and its
    bytes: a decode step sends one shape every time, so its `act` is made once."""

    MAX = 256

    def __init__(self, cap: int | None = None, kind: str = "") -> None:
        self.cap, self.kind = cap, kind  # (the slot's bytes, for a ring)
        self.made: dict[tuple[Any, tuple[int, ...]], tuple[dict[str, Any], int]] = {}

    def of(self, t: torch.Tensor | np.ndarray) -> tuple[dict[str, Any], int]:
        """`t`'s `act` and its bytes (checked against the slot once per shape)."""
        got = self.made.get((t.dtype, t.shape))
        if got is not None:
            return got
        nbytes = t.nbytes
        if self.cap is not None and nbytes > self.cap:
            raise ValueError(f"tensor of {nbytes} bytes exceeds the {self.kind} slot "
                             f"({self.cap} bytes)")
        if len(self.made) >= self.MAX:
            self.made.clear()
        made = self.made[(t.dtype, t.shape)] = (
            {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}, nbytes)
        return made


def _payload(msg: dict[str, Any], frames: list[zmq.Frame]) -> Any:
    """The payload buffer of a zmq step/result message (None when it carries none)."""
    if msg.get("act") is None:
        if frames:
            raise ProtocolError(f"{msg['type']}: payload frame without an activation descriptor")
        return None
    if len(frames) != 1:
        raise ProtocolError(f"{msg['type']}: expected 1 payload frame, got {len(frames)}")
    return frames[0].buffer


def zmq_tensor(msg: dict[str, Any], frames: list[zmq.Frame]) -> torch.Tensor | None:
    """The tensor of a zmq step/result message (None when it carries none)."""
    buf = _payload(msg, frames)
    return None if buf is None else tensor_from(buf, msg["act"])


def zmq_array(msg: dict[str, Any], frames: list[zmq.Frame]) -> np.ndarray | None:
    """`zmq_tensor` for the coordinator: a numpy view (`array_from`)."""
    buf = _payload(msg, frames)
    return None if buf is None else array_from(buf, msg["act"])


# ---- rings (shm, cuda-ipc) -----------------------------------------------------------------------
class RingSender:
    """Posts into a ring another process polls. Payload in the ring's host slot, or, with a
    `device` writer (cuda-ipc), in the receiver's device ring.

    `send` is the hop's hot path, run once per step per edge: it makes no syscall (the doorbell
    aside, for a sleeping receiver) and as few Python objects as it can: the header's `act` of
    a shape sent before is reused (a decode step sends one shape every time), the header is
    packed by one msgpack packer kept for the sender (`messages.encoder`), and an shm payload
    is one memmove into the slot's address, taken once."""

    def __init__(self, ring: ShmRing, doorbell: Callable[[], None] | None = None,
                 device: SlotWriter | None = None) -> None:
        self.ring, self.doorbell, self.device = ring, doorbell, device
        self.kind = "cuda-ipc" if device is not None else "shm"
        self.seq = 0
        self.timeout_s = 60.0  # a receiver that takes nothing for this long has stalled
        self._encode = encoder()  # (a sender is used by one thread)
        self._acts = Acts(device.slot_bytes if device is not None else ring.payload_bytes,
                          self.kind)
        self._payloads = None if device is not None else [ring.payload_address(i)
                                                          for i in range(ring.slots)]

    def send(self, header: dict[str, Any], t: torch.Tensor | np.ndarray | None) -> None:
        """`t`: a tensor, or a host numpy array (the coordinator's; shm only)."""
        ring = self.ring
        if ring.closed:  # (the slot addresses are gone with the mapping)
            raise ValueError(f"{self.kind} ring {ring.name} is closed")
        seq = self.seq
        slot = ring.wait_free(seq, self.timeout_s)
        if type(t) is np.ndarray:
            if self.device is not None:
                raise ValueError("a host array over cuda-ipc")
            t = np.ascontiguousarray(t)
            act, nbytes = self._acts.of(t)
            ctypes.memmove(self._payloads[slot], t.ctypes.data, nbytes)
            header["act"] = act
        elif t is not None:
            if t.requires_grad:
                t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            act, nbytes = self._acts.of(t)
            if self.device is not None:
                header["ev"] = self.device.write(slot, t, nbytes)
            else:
                if not t.is_cpu:
                    t = t.to("cpu")
                # one memmove: no intra-op thread pool to wake, no views made for a host copy
                ctypes.memmove(self._payloads[slot], t.data_ptr(), nbytes)
            header["act"] = act
        header["seq"] = seq
        ring.write_header(slot, self._encode(header))
        ring.publish(seq)
        self.seq = seq + 1
        if self.doorbell is not None and ring.sleeping:
            self.doorbell()

    def close(self) -> None:
        if self.device is not None:
            self.device.close()
        self.ring.close()
        self.device = None


class RingInbox:
    """The receiving end of a ring: `poll()` returns the next (header, tensor, seq) or None.

    The tensor views the ring until `release(seq)` (copy what is kept): host memory for shm
    (moved to `device` first unless that is the CPU; with no `device`, a numpy array: the
    coordinator's), a device slot for cuda-ipc, which the current stream may read once `poll`
    returns. A malformed message is consumed before the error is raised, so the ring stays in
    step."""

    def __init__(self, ring: ShmRing, device: torch.device | None,
                 device_buffer: torch.Tensor | None = None, device_slot_bytes: int = 0) -> None:
        self.ring, self.device = ring, device
        self.device_buffer, self.device_slot_bytes = device_buffer, device_slot_bytes
        self.reader: SlotReader | None = None
        if device_buffer is not None:
            from layersplit.ipc.cuda_handoff import SlotReader

            self.reader = SlotReader(device, ring.slots)
        self.views: dict[Any, Any] = {}  # (slot, dtype, shape) -> view of a device slot
        self.kind = "cuda-ipc" if device_buffer is not None else "shm"
        self.expected = 0

    def ready(self) -> bool:
        return self.ring.published > self.expected

    def poll(self) -> tuple[dict[str, Any], Any, int] | None:
        ring = self.ring
        seq = self.expected
        if ring.published <= seq:
            return None
        slot = seq % ring.slots
        self.expected = seq + 1
        try:
            msg = decode(ring.read_header(slot))
            got = msg.get("seq")
            if got != seq or type(got) is not int:
                raise ProtocolError(f"ring message carries seq {got!r}, expected {seq}")
            t = None
            act = msg.get("act")
            if act is not None:
                t = self._view(slot, act)
                if self.reader is not None:
                    self.reader.wait(slot, msg.get("ev"))
                elif self.device is not None and self.device.type != "cpu":
                    t = t.to(self.device)
        except ProtocolError as e:
            self.release(seq)
            e.sid = None
            raise
        return msg, t, seq

    def _view(self, slot: int, act: Any) -> Any:
        """The slot's payload (a device slot for cuda-ipc, else the host slot) viewed as the
        tensor `act` describes. Views are kept: a decode step sends the same shape every time,
        and making one costs more than the copy it names."""
        key = None
        if type(act) is dict:
            dtype, shape = act.get("dtype"), act.get("shape")
            if type(dtype) is str and type(shape) is list and _INT.issuperset(map(type, shape)):
                key = (slot, dtype, *shape)
        t = self.views.get(key) if key is not None else None
        if t is None:
            if self.device is None:
                t = array_from(self.ring.payload(slot), act)
            elif self.device_buffer is None:
                t = tensor_from(self.ring.payload(slot), act)
            else:
                import torch

                name, shape = _act(act)
                nbytes = math.prod(shape) * ITEMSIZE[name]
                if nbytes > self.device_slot_bytes:
                    raise ProtocolError(f"activation of {nbytes} bytes exceeds the slot")
                start = slot * self.device_slot_bytes
                t = self.device_buffer[start:start + nbytes].view(getattr(torch, name)).view(shape)
            if len(self.views) >= 256:
                self.views.clear()
            if key is not None:
                self.views[key] = t
        return t

    def release(self, seq: int) -> None:
        """Message `seq` is done with: every read of its slot has been made (host memory) or
        enqueued on the current stream (a device slot)."""
        if self.reader is not None:
            self.reader.done(seq % self.ring.slots)
        self.ring.release(seq)

    def sleep(self, value: bool) -> None:
        self.ring.set_sleeping(value)

    @property
    def closed(self) -> bool:
        return self.ring.closed

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.views.clear()  # (before the ring: a host view holds its mapping)
        self.ring.close()
        self.device_buffer = None
        self.reader = None


def share_cuda(buffer: torch.Tensor) -> dict[str, Any]:
    storage = buffer.untyped_storage()
    (dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync) = storage._share_cuda_()
    return {"device": int(dev), "handle": bytes(handle), "size": int(size), "offset": int(offset),
            "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(ev_handle) if ev_handle else None, "event_sync": bool(ev_sync)}


def open_cuda(h: dict[str, Any]) -> torch.Tensor:
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"], h["handle"], h["size"], h["offset"], h["ref_handle"], h["ref_offset"],
        h["event_handle"], h["event_sync"],
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage)


# ---- setup ---------------------------------------------------------------------------------------
def offer(kind: str, payload_bytes: int, device: torch.device | None,
          header_only_payload: int = 0) -> tuple[RingInbox | None, dict | None]:
    """Receiver side: create the memory of an inbound edge; return the inbox (None for zmq)
    and what the sender needs to map it. `device` None: an shm inbox of numpy arrays (the
    coordinator's)."""
    if kind == "zmq":
        return None, None
    if kind == "shm":
        ring = ShmRing.create(RING_SLOTS, payload_bytes)
        return RingInbox(ring, device), {"ring": ring.describe()}
    if kind == "cuda-ipc":
        import torch

        ring = ShmRing.create(RING_SLOTS, header_only_payload)
        try:
            buf = torch.empty(RING_SLOTS * payload_bytes, dtype=torch.uint8, device=device)
            inbox = RingInbox(ring, device, buf, payload_bytes)
            return inbox, {"ring": ring.describe(), "cuda": share_cuda(buf),
                           "cuda_slot_bytes": payload_bytes, "consumed": inbox.reader.handles}
        except BaseException:
            ring.close()
            raise
    raise ValueError(f"unknown transport {kind!r}")


def accept(kind: str, desc: dict | None, doorbell: Callable[[], None] | None,
           sock: zmq.Socket | None = None) -> Sender:
    """Sender side: map what the receiver offered."""
    if kind == "zmq":
        if sock is None:
            raise ValueError("a zmq sender needs its socket")
        return ZmqSender(sock)
    if not isinstance(desc, dict) or not isinstance(desc.get("ring"), dict):
        raise ProtocolError(f"{kind} link reply carries no ring description")
    if kind not in ("shm", "cuda-ipc"):
        raise ValueError(f"unknown transport {kind!r}")
    ring = ShmRing.attach(desc["ring"])
    if kind == "shm":
        return RingSender(ring, doorbell)
    try:
        from layersplit.ipc.cuda_handoff import SlotWriter

        consumed = desc.get("consumed")
        if consumed is not None and not (
                isinstance(consumed, list) and len(consumed) == ring.slots
                and all(isinstance(h, bytes) for h in consumed)):
            raise ProtocolError("cuda-ipc link reply: bad consumed-event handles")
        return RingSender(ring, doorbell, SlotWriter(open_cuda(desc["cuda"]),
                                                     int(desc["cuda_slot_bytes"]), consumed))
    except BaseException:
        ring.close()
        raise
