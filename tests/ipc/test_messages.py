"""The codec rejects every malformed header with a reason, and never pickles."""

from __future__ import annotations

import msgpack
import pytest
from layersplit.ipc.messages import (
    MAX_HEADER_BYTES,
    MAX_SEGMENTS,
    PROTOCOL_VERSION,
    ProtocolError,
    best_effort_sid,
    decode,
    encode,
    message,
    optional_seconds,
    segment,
)


def test_roundtrip():
    m = message("step", sid=3, seqs=[segment(0, 7, 2, None, True, [5], 0),
                                     segment(3, 1, 1)], act=None)
    assert decode(encode(m), payload_frames=1) == m


@pytest.mark.parametrize("seqs,why", [
    ([], "1..512 entries"),
    ([segment(0, 0, 1)] * (MAX_SEGMENTS + 1), "1..512 entries"),
    ([7], r"seqs\[0\] is a int"),
    ([{"slot": 0, "pos": 0, "n": 1}], r"seqs\[0\]: field 'sample' is missing"),
    ([segment(0, 0, 1), {**segment(1, 0, 1), "n": "2"}], r"seqs\[1\]: field 'n' must be int"),
    ([{**segment(0, 0, 1), "feat": True}], "field 'feat' must be int/NoneType"),
])
def test_bad_segments_are_named(seqs, why):
    with pytest.raises(ProtocolError, match=why):
        decode(encode(message("step", sid=1, seqs=seqs, act=None)))
    with pytest.raises(ProtocolError, match="outs"):
        decode(encode(message("result", sid=1, outs=[{"token": 1}], act=None)))


@pytest.mark.parametrize("frame,code", [
    (b"\xc1", "malformed"),
    (msgpack.packb([1, 2, 3]), "malformed"),
    (msgpack.packb({"type": "nope", "v": PROTOCOL_VERSION}), "unknown_type"),
    (msgpack.packb({"type": [1], "v": PROTOCOL_VERSION}), "unknown_type"),  # found by fuzzing
    (msgpack.packb({"type": {"a": 1}, "v": PROTOCOL_VERSION}), "unknown_type"),
    (msgpack.packb({"type": "ping", "v": 99}), "version"),
    # a v15 peer answers `warm` with `warmed`, which this side no longer knows: refused at hello
    (msgpack.packb({"type": "hello", "v": 15, "nonce": b"n" * 16, "role": "coordinator"}),
     "version"),
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
        decode(encode({"type": "result", "v": PROTOCOL_VERSION, "sid": True,
                       "outs": [{"token": 1, "accepted": 0, "logits": False}], "act": None}))
    with pytest.raises(ProtocolError, match="payload frames"):
        decode(encode(message("sample", sid=1, position=0, sample={})), payload_frames=0)
    with pytest.raises(ProtocolError, match="payload frames"):
        decode(encode(message("ping")), payload_frames=2)


def test_a_shape_of_message_seen_valid_lets_no_bad_value_through():
    """Valid maps are remembered by the types of their fields (the walk is skipped for those):
    the same message with one field of another type, a field missing or an extra segment that
    is bad is still refused by name, however often the good one came before."""
    good = message("step", sid=1, seqs=[segment(0, 5, 1)], act=None)
    for _ in range(3):
        assert decode(encode(good), payload_frames=1) == good
    bad = [({**good, "sid": True}, "field 'sid' must be int"),
           ({**good, "sid": 1.0}, "field 'sid' must be int"),
           ({**good, "seqs": [{**segment(0, 5, 1), "pos": False}]}, r"seqs\[0\]: field 'pos'"),
           ({**good, "seqs": [{**segment(0, 5, 1), "n": None}]}, r"seqs\[0\]: field 'n'"),
           ({**good, "seqs": [segment(0, 5, 1), {**segment(1, 5, 1), "draft": "x"}]},
            r"seqs\[1\]: field 'draft'"),
           ({k: v for k, v in good.items() if k != "act"}, "field 'act' is missing")]
    seg = segment(0, 5, 1)
    del seg["prev"]
    bad.append(({**good, "seqs": [seg]}, r"seqs\[0\]: field 'prev' is missing"))
    for msg, why in bad:
        with pytest.raises(ProtocolError, match=why):
            decode(encode(msg), payload_frames=1)
    assert decode(encode(good), payload_frames=1) == good


def test_streamed_cache_messages_carry_one_frame_per_named_tensor():
    saved = message("saved", entry=1, path="p", checksums={}, error=None, names=["a", "b"])
    assert decode(encode(saved), payload_frames=2)["names"] == ["a", "b"]
    for frames in (0, 1, 3):
        with pytest.raises(ProtocolError, match="expected 2 payload frames"):
            decode(encode(saved), payload_frames=frames)
    item = {"name": "a", "layer": 0, "kind": "k", "offset": 0}
    load = message("snap_load", path="p", slot=0, items=[item, item], stream=True, blocks=None)
    assert decode(encode(load), payload_frames=2)["stream"] is True
    with pytest.raises(ProtocolError, match="expected 0 payload frames"):
        decode(encode({**load, "stream": False}), payload_frames=2)
    with pytest.raises(ProtocolError, match="at most"):
        decode(encode({**saved, "names": ["a"] * 9000}), payload_frames=9000)


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


def test_the_largest_step_header_fits_a_ring_slot():
    """MAX_SEGMENTS verify segments with 15 draft tokens, large ids and seeds."""
    from layersplit.ipc.shm import HEADER_CAP

    seg = segment(511, 100_000, 16, {"temperature": 0.7, "top_k": 50, "top_p": 0.9,
                                     "seed": 2**62}, True, [150_000] * 15, 1023)
    m = message("step", sid=2**40, seqs=[seg] * MAX_SEGMENTS,
                act={"dtype": "bfloat16", "shape": [8192, 8192]})
    assert len(encode(m)) <= HEADER_CAP


def test_an_optional_duration_is_checked_by_name():
    saved = message("saved", entry=1, path="p", checksums=None, error=None, names=[])
    assert optional_seconds(saved, "copy_wait_s") == 0.0  # (absent: an older shard's)
    assert optional_seconds({**saved, "copy_wait_s": 0.25}, "copy_wait_s") == 0.25
    for bad in (True, 1, -0.5, float("nan"), float("inf"), "0.1", None):
        with pytest.raises(ProtocolError, match=r"saved: copy_wait_s must be a duration"):
            optional_seconds({**saved, "copy_wait_s": bad}, "copy_wait_s")
