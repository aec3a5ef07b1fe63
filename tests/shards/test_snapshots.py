"""The snapshot store's disk tier on its own: a streamed save and load never touch the file
(a shard on another host, or in a filesystem of its own, has no access to it), and give the
same bytes and checksums as a save into the file; the file writer puts every byte in place
through partial writes, and a write that fails is reported as the save's error."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from layersplit.ipc.kv_file import checksum
from layersplit.ipc.messages import ProtocolError, message
from layersplit.shards import snapshots
from layersplit.shards.snapshots import Snap, SnapshotStore, report_saves, snap_op, write_hashed


def _store() -> SnapshotStore:
    g = torch.Generator().manual_seed(0)
    tensors = {kind: torch.randn(2, 2, 32, 2, 4, generator=g) for kind in ("k", "v")}
    return SnapshotStore(tensors, max_len=32)


def _items(offset: int = 0) -> list[dict]:
    its, at = [], offset
    for layer in range(2):
        for kind in ("k", "v"):
            its.append({"name": f"ls0.L{layer}.{kind}", "layer": layer, "kind": kind,
                        "offset": at})
            at += 10 * 2 * 4 * 4
    return its


def _saved(store: SnapshotStore) -> tuple[dict, list]:
    """The next finished save's `saved` message and frames (saves run on a thread)."""
    got: list = []
    deadline = time.monotonic() + 10
    while not report_saves(store, lambda m, frames: got.append((m, frames))):
        assert time.monotonic() < deadline, "no save was reported"
        time.sleep(0.01)
    return got[0]


def test_streamed_save_and_load_never_touch_the_file(tmp_path):
    src = _store()
    src.take(1, slot=1, start=0, end=10)
    nowhere = str(tmp_path / "no-such-dir" / "entry.safetensors")  # could not be opened
    snap_op(src, message("snap_save", entry=1, path=nowhere, items=_items(), stream=True), None)
    msg, frames = _saved(src)
    assert msg["error"] is None and msg["names"] == [it["name"] for it in _items()]
    assert [checksum(f) for f in frames] == [msg["checksums"][n] for n in msg["names"]]

    # the same entry saved into a real file: the same bytes, the same checksums
    path = tmp_path / "entry.bin"
    path.write_bytes(b"\0" * 4096)
    snap_op(src, message("snap_save", entry=1, path=str(path), items=_items(), stream=False),
            str(tmp_path))
    filed, none = _saved(src)
    assert none == [] and filed["checksums"] == msg["checksums"] and filed["names"] == []
    data = path.read_bytes()
    for it, f in zip(_items(), frames):
        assert data[it["offset"]:it["offset"] + len(f)] == bytes(f)

    # a streamed load into another store (slot 0) gives the rows back exactly
    dst = _store()
    items = [{**it, "nbytes": len(f), "start": 0, "end": 10, "checksum": checksum(f)}
             for it, f in zip(_items(), frames)]

    class Frame:  # what zmq hands the handler: an object with a buffer
        def __init__(self, b):
            self.buffer = memoryview(bytes(b))

    info = snap_op(dst, message("snap_load", path=nowhere, slot=0, items=items, stream=True),
                   None, [Frame(f) for f in frames])
    assert info == {"bytes": sum(len(f) for f in frames)}
    for kind in ("k", "v"):
        assert torch.equal(dst.tensors[kind].read(0, 0, 10), src.tensors[kind].read(1, 0, 10))

    # a streamed tensor that does not match its checksum is a miss, reported, not loaded
    bad = [Frame(f) for f in frames]
    flipped = bytearray(bad[2].buffer)
    flipped[5] ^= 1
    bad[2] = Frame(flipped)
    info = snap_op(dst, message("snap_load", path=nowhere, slot=0, items=items, stream=True),
                   None, bad)
    assert "checksum mismatch" in info["error"]
    # frames where none belong, or too few of them, are refused by name
    with pytest.raises(ProtocolError, match="unexpected payload frames"):
        snap_op(dst, message("snap_save", entry=1, path=nowhere, items=_items(), stream=True),
                None, [Frame(b"x")])
    info = snap_op(dst, message("snap_load", path=nowhere, slot=0, items=items, stream=True),
                   None, bad[:2])
    assert "streamed for 4 items" in info["error"]
    assert not os.path.exists(nowhere)


def test_write_hashed_puts_every_byte_in_place_through_partial_writes(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    bufs = [memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g).numpy())
            for n in (100, 37, 5000, 64, 3)]
    # back to back (gathered into one call), then a gap, then one past the gather limit
    offsets = [8, 108, 145, 6000, 6064]
    monkeypatch.setattr(snapshots, "WRITEV_BYTES", 4096)
    calls = []
    real = os.pwritev

    def partial(fd, views, offset):  # at most 1000 bytes a call, as a filesystem may do
        calls.append(offset)
        want, got = 1000, []
        for v in views:
            got.append(v[:want])
            want -= len(got[-1])
            if want == 0:
                break
        return real(fd, got, offset)

    monkeypatch.setattr(os, "pwritev", partial)
    path = tmp_path / "entry.bin"
    path.write_bytes(b"\xff" * 7000)
    names = [f"t{i}" for i in range(len(bufs))]
    sums = write_hashed(str(path), offsets, bufs, names)
    assert sums == {n: checksum(b) for n, b in zip(names, bufs)}
    data = path.read_bytes()
    for off, b in zip(offsets, bufs):
        assert data[off:off + len(b)] == bytes(b)
    assert data[:8] == b"\xff" * 8 and data[6067:] == b"\xff" * (7000 - 6067)
    assert len(calls) > len(bufs)  # (the partial writes were continued)


def test_a_failed_write_is_the_saves_error(tmp_path, monkeypatch):
    src = _store()
    src.take(1, slot=0, start=0, end=10)
    path = tmp_path / "entry.bin"
    path.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: 0)  # a disk that takes nothing
    snap_op(src, message("snap_save", entry=1, path=str(path), items=_items(), stream=False),
            str(tmp_path))
    msg, frames = _saved(src)
    assert msg["checksums"] is None and "short write" in msg["error"] and frames == []


def test_a_save_takes_each_layer_once_it_is_copied_and_never_a_failed_copy():
    snap = Snap(0, 10, 0)
    host = {"k": torch.zeros(3, 10)}
    got: list = []

    def waiter(layer):
        try:
            got.append((layer, snap.wait_layer(layer) is host))
        except RuntimeError as e:
            got.append((layer, str(e)))

    ths = [threading.Thread(target=waiter, args=(layer,)) for layer in (-1, 1, 2)]
    for th in ths:
        th.start()
    time.sleep(0.05)
    assert got == []  # no buffers yet
    snap.advance(0, host)
    ths[0].join(5)
    time.sleep(0.05)
    assert got == [(-1, True)]  # the buffers exist; layer 1 is not copied yet
    snap.advance(2)
    ths[1].join(5)
    assert got == [(-1, True), (1, True)]
    snap.error = "RuntimeError: out of pinned memory"  # the copy of layer 2 failed
    snap.done()
    ths[2].join(5)
    assert got[2] == (2, "snapshot copy failed: RuntimeError: out of pinned memory")


def test_an_idle_loop_blocks_briefly_while_a_save_is_in_flight(tmp_path, monkeypatch):
    src = _store()
    assert snapshots.block_ms(None, 200) == 200 and snapshots.block_ms(src, 200) == 200
    gate = threading.Event()
    real = snapshots.write_hashed
    monkeypatch.setattr(snapshots, "write_hashed", lambda *a: (gate.wait(5), real(*a))[1])
    path = tmp_path / "entry.bin"
    path.write_bytes(b"\0" * 4096)
    src.take(1, slot=0, start=0, end=10)
    snap_op(src, message("snap_save", entry=1, path=str(path), items=_items(), stream=False),
            str(tmp_path))
    assert snapshots.block_ms(src, 200) == snapshots.SAVE_POLL_MS  # writing
    gate.set()
    deadline = time.monotonic() + 10
    while src.results.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert snapshots.block_ms(src, 200) == snapshots.SAVE_POLL_MS  # its outcome not yet sent
    msg, _ = _saved(src)
    assert msg["error"] is None
    while src.saving:  # (the thread ends just after handing over its outcome)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert snapshots.block_ms(src, 200) == 200


def test_a_copy_that_ended_early_is_never_written():
    """A snapshot's copy whose thread ended (no error of its own) before a layer was copied:
    a save waiting for that layer fails, rather than write rows that were never copied."""
    snap = Snap(0, 4, 0, 0)
    snap.advance(1, {"k": torch.zeros(3, 4)})
    snap.done()
    assert snap.wait_layer(0)["k"].shape == (3, 4)
    with pytest.raises(RuntimeError, match="ended before layer 2"):
        snap.wait_layer(2)
