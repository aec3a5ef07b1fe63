"""The snapshot store's disk tier on its own: a streamed save and load never touch the file
(a shard on another host, or in a filesystem of its own, has no access to it), and give the
same bytes and checksums as a save into the file."""

from __future__ import annotations

import os
import time

import pytest
import torch
from layersplit.ipc.kv_file import checksum
from layersplit.ipc.messages import ProtocolError, message
from layersplit.shards.snapshots import SnapshotStore, report_saves, snap_op


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
