"""A host shared-memory ring: a single-producer single-consumer message queue between two
processes of one host, waited on by spinning, with a zmq doorbell for a sleeping receiver.

Layout: a 192-byte control block (`released` written by the receiver, `published` by the sender,
`sleeping` by the receiver, each on its own cache line), then `slots` slots of
[u32 header length | header (msgpack) | payload]. A message is visible once `published` passes
its sequence number; the payload may also live elsewhere (a device ring, for cuda-ipc).

Waiting is by polling shared memory, not by a syscall: a process on another core sees a message
within a microsecond, with no wake-up of a sleeping thread. A receiver that has been idle for its
spin window sets `sleeping` and blocks on its zmq socket; a sender that finds it sleeping rings
a doorbell (a tiny zmq message). Without a memory fence a doorbell can be missed in a rare race;
the sleeper's poll timeout (`SLEEP_POLL_MS`) bounds the cost of that.

Lifetime: one side creates the segment in /dev/shm with mode 0600, the other maps it and at once
unlinks the name. From then on the memory lives exactly as long as the two mappings, so no exit
path, clean or kill -9, can leave a segment behind. The coordinator sweeps `layersplit-<pid>-*`
of children killed before that point, and the files CUDA's interprocess events of a child left
(`cuda_event_files`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "layersplit-"
CONTROL_BYTES = 192
_RELEASED, _PUBLISHED, _SLEEPING = 0, 64, 128
HEADER_CAP = (128 << 10) - 8  # bytes of msgpack header per slot: a step of MAX_SEGMENTS
# sequences, verify segments with their draft tokens included (one segment is ~100-250 bytes)
SLOT_HEADER = 8 + HEADER_CAP
SLEEP_POLL_MS = 2


def segment_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def sweep(pid: int) -> list[str]:
    """Unlink segments a (dead) process created and had not yet handed over, and the files of
    its CUDA interprocess events (`cuda_event_files`)."""
    # (a child's event files are newer than this process: it started the child)
    return _unlink([*_own(SHM_DIR.glob(f"{PREFIX}{pid}-*")), *cuda_event_files(pid, _started())])


def _unlink(paths: list[Path]) -> list[str]:
    """Unlink `paths`; the names of those removed (one gone already, or not ours to remove,
    does not stop the others)."""
    removed = []
    for p in paths:
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed


def _own(paths, since: float = 0.0) -> list[Path]:
    """Those of `paths` that belong to our user and were made at `since` (seconds since the
    epoch) or later (another user's file of the same name, from a process of the same pid in
    another pid namespace sharing /dev/shm, is never touched)."""
    out = []
    for p in paths:
        try:
            st = p.lstat()  # (the name's owner, a link's included)
        except OSError:  # (gone meanwhile)
            continue
        if st.st_uid == os.getuid() and st.st_ctime >= since:
            out.append(p)
    return out


# CUDA interprocess events are backed by small files that NVIDIA's driver creates in /dev/shm,
# named `cuda.shm.<n>.<creator's pid in hex>.<n>`: ours (`ipc.cuda_handoff.ipc_events`, the
# slot events of a cuda-ipc ring, the token board's event) and torch's (the event
# `UntypedStorage._share_cuda_` makes for the ring buffer a receiver shares). The driver unlinks
# them in its own teardown at process exit, which our shard and draft processes skip: they end
# in `os._exit` (`launch.processes._run_server_process`: no interpreter finalization, so no
# library destructors), and one killed never runs it. So every start of a GPU server left a few
# of these files behind after every process had exited (5 a start, on the device). A process
# removes its own at exit (`release_cuda_event_files`), the coordinator those of a child that
# did not (`sweep`). Only files of our user whose name carries the pid and that are newer than
# the process (for a sweep: than the coordinator, which started it) are touched. Residual risk: a
# process of the same user and pid in another pid namespace sharing /dev/shm, whose event files
# are newer than ours; GPU runs confirm these are the driver's files (tests/gpu/test_dev_shm.py).
CUDA_SHM = "cuda.shm."


def _cuda_shm_pid(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) < 4 or not name.startswith(CUDA_SHM):
        return None
    try:
        return int(parts[-2], 16)
    except ValueError:
        return None


def cuda_event_files(pid: int, since: float) -> list[Path]:
    """The /dev/shm files of CUDA interprocess events process `pid` created (of our user, made
    at `since` (seconds since the epoch) or later)."""
    try:
        found = [p for p in SHM_DIR.glob(f"{CUDA_SHM}*") if _cuda_shm_pid(p.name) == pid]
    except OSError:
        return []
    return _own(found, since)


def _started() -> float:
    """When this process started, seconds since the epoch."""
    return psutil.Process().create_time()


def release_cuda_event_files() -> list[str]:
    """At a process's exit (it ends in `os._exit`): unlink the files of the CUDA interprocess
    events it created (`cuda_event_files`; a peer's mapping lives on without the name). A
    process that never used CUDA has none, and pays one glob of /dev/shm."""
    return _unlink(cuda_event_files(os.getpid(), _started()))


def _stride(payload_bytes: int) -> int:
    return -(-(SLOT_HEADER + payload_bytes) // 64) * 64


_U32 = struct.Struct("<I")


class ShmRing:
    def __init__(self, name: str, mm: mmap.mmap, slots: int, payload_bytes: int) -> None:
        self.name, self.mm, self.slots, self.payload_bytes = name, mm, slots, payload_bytes
        self.stride = _stride(payload_bytes)
        self.buf = memoryview(mm)
        # the counters as C integers over the mapping: one attribute read or write each, no
        # struct call (ctypes' exports of the mapping, let go at `close`)
        self._released, self._published, self._sleeping = (
            ctypes.c_uint64.from_buffer(mm, off) for off in (_RELEASED, _PUBLISHED, _SLEEPING))
        # each slot's header area, sliced once (a message's header is a slice of it)
        self._headers = [self.buf[self._slot(i) + 8:self._slot(i) + 8 + HEADER_CAP]
                         for i in range(slots)]
        self.unlinked = False
        self.closed = False
        self._known_released = 0  # the sender's last read of `released` (it only grows)

    @staticmethod
    def size_for(slots: int, payload_bytes: int) -> int:
        return CONTROL_BYTES + slots * _stride(payload_bytes)

    def describe(self) -> dict:
        return {"name": self.name, "slots": self.slots, "payload_bytes": self.payload_bytes}

    @classmethod
    def create(cls, slots: int, payload_bytes: int) -> ShmRing:
        name = segment_name()
        size = cls.size_for(slots, payload_bytes)
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(name, mm, slots, payload_bytes)

    @classmethod
    def attach(cls, desc: dict) -> ShmRing:
        """Map a ring another process created (and unlink its name: both ends now hold it)."""
        try:
            name, slots, payload = str(desc["name"]), int(desc["slots"]), int(desc["payload_bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad shared-memory ring description {desc!r}") from e
        if not name.startswith(PREFIX) or "/" in name or slots < 1 or payload < 0:
            raise ValueError(f"shared-memory ring {name!r} is not one of ours")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != cls.size_for(slots, payload):
                raise ValueError(f"shared memory {name} has {size} bytes, expected "
                                 f"{cls.size_for(slots, payload)}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ring = cls(name, mm, slots, payload)
        ring.unlink()
        return ring

    def unlink(self) -> None:
        """Remove the name (the memory stays while mapped). Idempotent, either side."""
        if not self.unlinked:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.unlinked = True

    # -- counters (after `close`, each raises AttributeError: the mapping is gone) ---------------
    @property
    def released(self) -> int:
        return self._released.value

    @property
    def published(self) -> int:
        return self._published.value

    @property
    def sleeping(self) -> bool:
        return self._sleeping.value != 0

    def set_sleeping(self, value: bool) -> None:
        self._sleeping.value = 1 if value else 0

    def release(self, seq: int) -> None:
        """Receiver: every message up to and including `seq` is consumed."""
        self._released.value = seq + 1

    def publish(self, seq: int) -> None:
        """Sender: message `seq` (header and payload) is complete."""
        self._published.value = seq + 1

    def wait_free(self, seq: int, timeout_s: float = 60.0) -> int:
        """Sender: block until message `seq` may be written; return its slot. (The receiver's
        counter is read only when the last one read does not already free the slot.)"""
        if seq - self._known_released < self.slots:
            return seq % self.slots
        self._known_released = self.released
        if seq - self._known_released >= self.slots:
            deadline = time.monotonic() + timeout_s
            delay = 10e-6
            while seq - self.released >= self.slots:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shared-memory ring {self.name}: receiver stalled")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
            self._known_released = self.released
        return seq % self.slots

    # -- slots ------------------------------------------------------------------------------------
    def _slot(self, index: int) -> int:
        return CONTROL_BYTES + index * self.stride

    def write_header(self, index: int, header: bytes) -> None:
        n = len(header)
        if n > HEADER_CAP:
            raise ValueError(f"message header of {n} bytes exceeds {HEADER_CAP}")
        self._headers[index][:n] = header
        _U32.pack_into(self.buf, CONTROL_BYTES + index * self.stride, n)

    def read_header(self, index: int) -> memoryview:
        n = _U32.unpack_from(self.buf, CONTROL_BYTES + index * self.stride)[0]
        return self._headers[index][:n]  # (a length past the cap reads the whole area)

    def payload_address(self, index: int) -> int:
        """The address of slot `index`'s payload in this process (valid until `close`; a
        sender's memmove target: no memoryview or array made per message)."""
        probe = ctypes.c_char.from_buffer(self.mm)  # (an export of the mapping, let go at once)
        try:
            return ctypes.addressof(probe) + self._slot(index) + SLOT_HEADER
        finally:
            del probe

    def payload(self, index: int) -> memoryview:
        off = self._slot(index) + SLOT_HEADER
        return self.buf[off:off + self.payload_bytes]

    def close(self) -> None:
        self.unlink()
        self.closed = True
        # (the exports of the mapping go first, or it could not be closed)
        self._released = self._published = self._sleeping = None
        for h in self._headers:
            h.release()
        self._headers = []
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:  # a tensor still views the ring; the mapping goes with the process
            pass
