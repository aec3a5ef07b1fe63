"""Ordering a cuda-ipc edge on the GPUs, so that no host waits for a hop's copy.

A cuda-ipc edge is a ring of device slots the receiver owns and the sender writes by
device-to-device copy. Two CUDA IPC events per slot order the two processes' streams:

- *ready* (created and recorded by the sender): the sender enqueues the copy into the slot on its
  stream, records the slot's ready event after it and publishes the message at once; the message
  header names the event (`ev`), and the receiver's stream waits on it (cudaStreamWaitEvent)
  before anything reads the slot. The receiver's host can therefore enqueue its step while the
  sender's GPU is still computing the rows it will read.
- *consumed* (created and recorded by the receiver): when the receiver releases the slot it
  records the slot's consumed event on its stream (after every read it enqueued); the sender's
  stream waits on it before its next copy into that slot. The host ring's credit (`released`)
  is only given after that record, so the wait always sees it.

An event is recorded only by the process that created it; the other opens it by handle into the
context of its own device (torch's `Event(interprocess=True)`; HIP IPC events on ROCm). A
platform without IPC events falls back to the host waits of old: the sender synchronizes its
copy before publishing (no `ev` in the header), the receiver synchronizes its stream before
releasing a slot.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from layersplit.ipc.messages import ProtocolError

log = logging.getLogger(__name__)

_cupy: Any = None
IPC_EVENTS_OFF = False  # as on a platform without IPC events (a test of the fallback sets it)


def _load_cupy() -> Any:
    """CuPy's runtime module where it is installed (one cudaMemcpyAsync per hop), else False
    (torch's cross-device `copy_`, which also orders both devices' streams with events)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy

            _cupy = cupy
        except ImportError:
            _cupy = False
    return _cupy


def ipc_events(n: int, device: torch.device) -> tuple[list[torch.cuda.Event], list[bytes]] | None:
    """n interprocess events on `device` and their handles; None where the platform has none."""
    if IPC_EVENTS_OFF:
        return None
    try:
        with torch.cuda.device(device):
            events = [torch.cuda.Event(interprocess=True) for _ in range(n)]
            return events, [bytes(e.ipc_handle()) for e in events]
    except (RuntimeError, AttributeError) as e:
        log.warning("no CUDA IPC events on %s (%s): cuda-ipc hops synchronize on the host",
                    device, e)
        return None


class SlotWriter:
    """The sender's half: copies a tensor into slot `i` of the receiver's device ring.

    With CuPy the hot path is three raw runtime calls (wait, memcpy, record) on handles taken
    once; without it, torch's Python wrappers (a few µs more per hop)."""

    def __init__(self, ring: torch.Tensor, slot_bytes: int, consumed: list[bytes] | None) -> None:
        self.ring, self.slot_bytes = ring, slot_bytes
        self.base, self.ring_index = ring.data_ptr(), ring.device.index
        self.consumed_handles = consumed
        self.consumed: list[torch.cuda.Event] | None = None
        self.device_index = -1  # the source device, bound on the first copy
        self.stream: torch.cuda.Stream | None = None
        self.ready: list[torch.cuda.Event] | None = None
        self.ready_desc: list[list[Any]] = []
        self.raw = False  # CuPy's runtime calls on the current device
        self.peer = False  # the source is another device than the ring's
        self.stream_raw = 0
        self.consumed_raw: list[int] = []
        self.ready_raw: list[int] | None = None

    def _bind(self, device: torch.device) -> None:
        """Take this process's stream and events for copies from `device`. Bound only once all
        of it succeeded: a failed bind is tried again on the next copy, never half applied."""
        self.device_index = -1
        self.stream = torch.cuda.current_stream(device)
        cupy = _load_cupy()
        self.raw = bool(cupy) and torch.cuda.current_device() == device.index
        self.peer = device.index != self.ring_index
        if self.raw and self.peer:
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(self.ring_index)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # already enabled (or impossible: the driver then stages the copy)
        if not self.consumed_handles:  # the receiver synchronizes before it frees a slot
            self.device_index = device.index
            return
        try:  # opened into this process's own device context, as the receiver opens ours
            self.consumed = [torch.cuda.Event.from_ipc_handle(device, h)
                             for h in self.consumed_handles]
        except RuntimeError as e:
            raise RuntimeError(f"cuda-ipc: cannot open the receiver's slot events ({e}); set "
                               "this edge's transport to shm") from None
        made = ipc_events(len(self.consumed_handles), device)
        if made is not None:
            self.ready = made[0]
            self.ready_desc = [[device.index, h] for h in made[1]]
        if self.raw:  # the raw handles of the hot path
            self.stream_raw = self.stream.cuda_stream
            self.consumed_raw = [e.cuda_event for e in self.consumed]
            self.ready_raw = None if self.ready is None else [e.cuda_event for e in self.ready]
        self.device_index = device.index

    def close(self) -> None:
        """Before the mapping goes: the last copies into the receiver's memory have landed."""
        if self.stream is not None:
            self.stream.synchronize()

    def write(self, slot: int, src: torch.Tensor, nbytes: int) -> list[Any] | None:
        """Enqueue the copy of `src` (contiguous, on this process's device) into `slot`; returns
        the header's `ev` (the slot's ready event), or None once the copy has landed (no IPC
        events: synchronized here)."""
        if src.get_device() != self.device_index:
            self._bind(src.device)
        stream = self.stream
        if self.raw:
            rt = _cupy.cuda.runtime
            handle = self.stream_raw
            if self.consumed is not None:
                rt.streamWaitEvent(handle, self.consumed_raw[slot], 0)
            if self.peer:  # an explicit peer copy: no pointer lookups to find the devices
                rt.memcpyPeerAsync(self.base + slot * self.slot_bytes, self.ring_index,
                                   src.data_ptr(), self.device_index, nbytes, handle)
            else:
                rt.memcpyAsync(self.base + slot * self.slot_bytes, src.data_ptr(), nbytes,
                               rt.memcpyDeviceToDevice, handle)
            if self.ready is not None:
                rt.eventRecord(self.ready_raw[slot], handle)
                return self.ready_desc[slot]
        else:
            if self.consumed is not None:
                stream.wait_event(self.consumed[slot])
            start = slot * self.slot_bytes
            self.ring[start:start + nbytes].copy_(src.view(torch.uint8).reshape(-1),
                                                  non_blocking=True)
            if self.ready is not None:
                self.ready[slot].record(stream)
                return self.ready_desc[slot]
        stream.synchronize()
        if self.peer and not self.raw:
            torch.cuda.current_stream(self.ring.device).synchronize()
        return None


class SlotReader:
    """The receiver's half: orders its stream after the sender's copy into a slot, and tells
    the sender when its reads of a slot are done. The receiver reads on its device's current
    stream (taken once: the processes here never switch streams around their inboxes)."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        made = ipc_events(slots, device)
        self.consumed, self.handles = (None, None) if made is None else made
        # slot -> (handle bytes, opened event, its raw handle)
        self.ready: dict[int, tuple[bytes, torch.cuda.Event, int]] = {}
        self.stream: torch.cuda.Stream | None = None
        self.rt = None  # CuPy's runtime module, for raw wait/record calls
        self.stream_raw = 0
        self.consumed_raw: list[int] = []

    def _stream(self) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.current_stream(self.device)
            cupy = _load_cupy()
            self.rt = cupy.cuda.runtime if cupy else None
            self.stream_raw = self.stream.cuda_stream
            self.consumed_raw = [e.cuda_event for e in self.consumed or ()]
        return self.stream

    def wait(self, slot: int, ev: Any) -> None:
        """Before anything reads `slot`: the current stream waits on the sender's ready event
        (`ev` from the header; None when the sender synchronized its copy itself)."""
        if ev is None:
            return
        known = self.ready.get(slot)
        if known is None or type(ev) is not list or len(ev) != 2 or known[0] != ev[1] \
                or type(ev[0]) is not int:  # (else the slot's event as last time, checked then)
            known = self._open(slot, ev)
        stream = self._stream()
        if self.rt is not None:
            self.rt.streamWaitEvent(self.stream_raw, known[2], 0)
        else:
            stream.wait_event(known[1])

    def _open(self, slot: int, ev: Any) -> tuple[bytes, torch.cuda.Event, int]:
        """Check a header's `ev` and open the event it names for `slot` (kept for the next
        messages through the slot, which name the same one)."""
        if not (isinstance(ev, list) and len(ev) == 2 and isinstance(ev[0], int)
                and isinstance(ev[1], bytes)):
            raise ProtocolError(f"cuda-ipc message carries a bad ready event {ev!r}"[:200])
        known = self.ready.get(slot)
        if known is not None and known[0] == ev[1]:
            return known
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, ev[1])
        except RuntimeError as e:
            raise ProtocolError(f"cuda-ipc: cannot open the sender's ready event: {e}") \
                from None
        known = self.ready[slot] = (ev[1], event, event.cuda_event)
        return known

    def close(self) -> None:
        """Before the ring is freed: no kernel of ours still reads it."""
        if self.stream is not None:
            self.stream.synchronize()

    def done(self, slot: int) -> None:
        """Every read of `slot` is enqueued: the sender may overwrite it once they have run."""
        stream = self._stream()
        if self.consumed is None:
            stream.synchronize()
        elif self.rt is not None:
            self.rt.eventRecord(self.consumed_raw[slot], self.stream_raw)
        else:
            self.consumed[slot].record(stream)
