"""A host shared-memory ring: a control block plus fixed-size slots, one ring per chain edge.

The receiver creates the segment in /dev/shm with mode 0600; the sender maps it; then the
receiver unlinks the name at once. From then on the memory lives exactly as long as the two
mappings, so no exit path, clean or kill -9, can leave a segment behind. Until that moment the
creator unlinks on any exit, and the coordinator sweeps `layersplit-<pid>-*` of dead children.

Flow control: the sender numbers messages (seq) and may write slot seq % slots only once the
receiver has released seq - slots (the `released` counter in the control block).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "layersplit-"
CONTROL_BYTES = 64  # [0:8) released counter (uint64, written by the receiver only)


def segment_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def sweep(pid: int) -> list[str]:
    """Unlink segments a (dead) process created and had not yet handed over."""
    removed = []
    for p in SHM_DIR.glob(f"{PREFIX}{pid}-*"):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    return removed


class ShmRing:
    def __init__(self, name: str, mm: mmap.mmap, slots: int, slot_bytes: int, owner: bool) -> None:
        self.name, self.mm, self.slots, self.slot_bytes = name, mm, slots, slot_bytes
        self.owner = owner
        self.linked = False
        self.buf = memoryview(mm)

    @property
    def size(self) -> int:
        return CONTROL_BYTES + self.slots * self.slot_bytes

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> ShmRing:
        name = segment_name()
        size = CONTROL_BYTES + slots * slot_bytes
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
        return cls(name, mm, slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, slots: int, slot_bytes: int) -> ShmRing:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shared-memory name {name!r} is not one of ours")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != CONTROL_BYTES + slots * slot_bytes:
                raise ValueError(f"shared memory {name} has {size} bytes, expected "
                                 f"{CONTROL_BYTES + slots * slot_bytes}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, slots, slot_bytes, owner=False)

    def unlink(self) -> None:
        """Remove the name (memory stays while mapped). Idempotent."""
        if self.owner and not self.linked:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.linked = True

    # -- counters ---------------------------------------------------------------------------------
    @property
    def released(self) -> int:
        return struct.unpack_from("<Q", self.buf, 0)[0]

    def release(self, seq: int) -> None:
        """Receiver: every message up to and including `seq` is consumed."""
        struct.pack_into("<Q", self.buf, 0, seq + 1)

    def wait_free(self, seq: int, timeout_s: float = 60.0) -> int:
        """Sender: block until message `seq` may be written; return its slot."""
        if seq - self.released >= self.slots:
            deadline = time.monotonic() + timeout_s
            delay = 20e-6
            while seq - self.released >= self.slots:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shared-memory ring {self.name}: receiver stalled")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        return seq % self.slots

    def slot(self, index: int) -> memoryview:
        start = CONTROL_BYTES + index * self.slot_bytes
        return self.buf[start:start + self.slot_bytes]

    def close(self) -> None:
        self.unlink()
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:  # a tensor still views the ring; the mapping goes with the process
            pass
