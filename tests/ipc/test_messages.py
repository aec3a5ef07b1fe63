"""The codec rejects every malformed header with a reason, and never pickles."""

from __future__ import annotations

import msgpack
import pytest

from ipc.messages import (
    MAX_HEADER_BYTES, PROTOCOL_VERSION, ProtocolError, best_effort_sid, decode, encode, message,
)


def test_roundtrip():
    m = message("step", sid=3, slot=0, pos=7, n=2, sample=None, logits=True, act=None,
                draft=[5], feat=True)
    assert decode(encode(m), payload_frames=1) == m


@pytest.mark.parametrize("frame,code", [
    (b"\xc1", "malformed"),
    (msgpack.packb([1, 2, 3]), "malformed"),
    (msgpack.packb({"type": "nope", "v": PROTOCOL_VERSION}), "unknown_type"),
    (msgpack.packb({"type": "ping", "v": 99}), "version"),
    (msgpack.packb({"type": "auth", "v": PROTOCOL_VERSION}), "bad_message"),
    (msgpack.packb({"type": "auth", "v": PROTOCOL_VERSION, "mac": "text"}), "bad_message"),
    (msgpack.packb({"type": "ping", "v": PROTOCOL_VERSION, "x": b"0" * MAX_HEADER_BYTES}),
     "oversized"),
])
def test_rejections(frame, code):
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.code == code


def test_bool_is_not_int_and_frame_counts_are_checked():
    with pytest.raises(ProtocolError, match="sid"):
        decode(encode({"type": "result", "v": PROTOCOL_VERSION, "sid": True, "token": 1,
                            "accepted": 0, "has_logits": False}))
    with pytest.raises(ProtocolError, match="payload frames"):
        decode(encode(message("sample", sid=1, position=0, sample={})), payload_frames=0)
    with pytest.raises(ProtocolError, match="payload frames"):
        decode(encode(message("ping")), payload_frames=2)


def test_best_effort_sid():
    assert best_effort_sid(encode({"type": "step", "sid": 9})) == 9
    assert best_effort_sid(b"\xc1") is None


def test_no_pickle_in_the_codebase():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg in ("ipc", "runtime", "shards", "draft", "launch"):
        for f in (root / pkg).rglob("*.py"):
            text = f.read_text()
            assert "import pickle" not in text and "weights_only=False" not in text, f
