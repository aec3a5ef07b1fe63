"""Frames fuzzed with hypothesis, for every message type of `ipc.messages`.

The codec: a valid message of any type round-trips; a mutated one (a field dropped or of the
wrong type, an unknown type or version, the wrong number of payload frames, a bad segment, the
bytes cut short or flipped) is either still a valid message or a ProtocolError naming the
problem, never another exception.

A live shard: every invalid frame, from an unauthenticated peer, its coordinator (on the
coordinator's own channel) or an authenticated upstream shard, gets an error reply with a code
and a reason; the channel reads the next message from its start (a ping right after gets its
answer); the run's output is unchanged at the end.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from layersplit.ipc import auth
from layersplit.ipc.messages import (
    CACHE_FRAMES,
    MAX_FRAMES,
    NESTED,
    PAYLOAD_FRAMES,
    PROTOCOL_VERSION,
    SCHEMAS,
    ProtocolError,
    decode,
    encode,
    message,
)
from layersplit.ipc.sockets import connect_dealer
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

TYPES = sorted(SCHEMAS)
# the campaign run (bench/RESULTS.md) sets more; --hypothesis-show-statistics counts the cases
# per message type and mutation
SCALE = int(os.environ.get("LAYERSPLIT_FUZZ_SCALE", "1"))
CODES = {"malformed", "unknown_type", "version", "bad_message", "oversized", "unauthenticated",
         "unexpected"}
WRONG = [7, "x", b"x", [1], {"a": 1}, None, 1.5, True]
_VALUES = {int: st.integers(-2**63, 2**63 - 1), str: st.text(max_size=12),
           bytes: st.binary(max_size=12), list: st.lists(st.integers(0, 9), max_size=3),
           dict: st.dictionaries(st.text(max_size=4), st.integers(-9, 9), max_size=2),
           type(None): st.none(), float: st.floats(allow_nan=False), bool: st.booleans()}


def _fields(schema: dict[str, tuple[type, ...]]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({f: st.one_of(*[_VALUES[t] for t in types])
                                  for f, types in schema.items()})


@st.composite
def valid_messages(draw, types=TYPES) -> tuple[dict, int]:
    """(a valid message of any type, its number of payload frames)."""
    t = draw(st.sampled_from(types))
    msg = {"type": t, "v": PROTOCOL_VERSION, **draw(_fields(SCHEMAS[t]))}
    if t in NESTED:
        field, schema = NESTED[t]
        msg[field] = draw(st.lists(_fields(schema), min_size=1, max_size=3))
    frames = PAYLOAD_FRAMES.get(t, 0)
    if t in CACHE_FRAMES:  # one frame per tensor the header names
        frames = CACHE_FRAMES[t](msg)
    elif frames is None:
        frames = draw(st.integers(0, MAX_FRAMES))
    return msg, frames


def _wrong_value(types: tuple[type, ...]) -> object:
    for v in WRONG:
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if not ok:
            return v
    raise AssertionError(types)


@st.composite
def invalid_frames(draw, types=TYPES) -> tuple[str, bytes, int]:
    """(what was broken, header bytes, payload frames): a frame no schema accepts."""
    msg, frames = draw(valid_messages(types))
    t = msg["type"]
    how = draw(st.sampled_from(["drop", "retype", "type", "version", "frames", "nested",
                                "cut", "not a map"]))
    if how in ("drop", "retype") and not SCHEMAS[t]:
        how = "frames"
    if how == "nested" and t not in NESTED:
        how = "type"
    if how == "frames" and t in CACHE_FRAMES:
        frames = CACHE_FRAMES[t](msg) + draw(st.integers(1, 2))
    elif how == "frames" and PAYLOAD_FRAMES.get(t, 0) is None:
        frames = MAX_FRAMES + 1  # too many for any type
    elif how == "frames":
        frames = PAYLOAD_FRAMES.get(t, 0) + draw(st.integers(1, 2))
    if how == "drop":
        del msg[draw(st.sampled_from(sorted(SCHEMAS[t])))]
    elif how == "retype":
        f = draw(st.sampled_from(sorted(SCHEMAS[t])))
        msg[f] = _wrong_value(SCHEMAS[t][f])
    elif how == "type":
        msg["type"] = draw(st.sampled_from(["", "x" + t, t.upper(), 7, [t], {t: 1}]))
    elif how == "version":
        msg["v"] = draw(st.sampled_from([PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, "7", None]))
    elif how == "nested":
        field, schema = NESTED[t]
        item = msg[field][0]
        f = draw(st.sampled_from(sorted(schema)))
        if draw(st.booleans()):
            del item[f]
        else:
            item[f] = _wrong_value(schema[f])
    raw = encode(msg)
    if how == "cut":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "not a map":
        raw = msgpack.packb(draw(st.sampled_from([[t], t, 7, None])))
    return f"{t}: {how}", raw, frames


@settings(max_examples=600 * SCALE, deadline=None)
@given(valid_messages())
def test_every_valid_message_roundtrips(case):
    msg, frames = case
    assert decode(encode(msg), frames) == msg


@settings(max_examples=1500 * SCALE, deadline=None)
@given(invalid_frames())
def test_every_invalid_frame_is_a_protocol_error(case):
    what, raw, frames = case
    event(what)
    with pytest.raises(ProtocolError) as e:
        decode(raw, frames)
    assert e.value.code in CODES and str(e.value), what


@settings(max_examples=1500 * SCALE, deadline=None)
@given(valid_messages(), st.data())
def test_flipped_bytes_are_a_message_or_a_protocol_error(case, data):
    msg, frames = case
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    try:
        got = decode(bytes(raw), frames)
    except ProtocolError as e:
        assert e.code in CODES and str(e)
    else:
        assert got["type"] in SCHEMAS  # still valid: a flip inside a value


# ---- a live shard ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tiny_llama):
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), prefill_chunk=16,
                        max_context=256, threads=1, local_addresses="tcp")
    with Coordinator(cfg) as coord:
        p = SamplingParams(max_tokens=6, ignore_eos=True)
        prompt = coord.tokenizer.encode("the cat sat on the mat")
        want = coord.generate(prompt, p, use_cache=False).tokens
        peers = {}
        for sh in coord.shards:
            # the coordinator's own channel (a second coordinator would take the shard over)
            peers[sh.index, "coordinator"] = sh.sock
            for role in (None, "upstream"):
                peers[sh.index, role] = _peer(sh.address, coord.secret, role)
        yield coord, peers
        for (_, role), s in peers.items():
            if role != "coordinator":
                s.close(0)
        assert coord.failed is None
        assert coord.generate(prompt, p, use_cache=False).tokens == want


def _peer(address: str, secret: bytes, role: str | None) -> zmq.Socket:
    """A raw peer inside the tcp:// edge's encrypted channel (`ipc.curve`); with `role`, also
    past the HMAC handshake."""
    s = connect_dealer(zmq.Context.instance(), address, secret)
    if role is not None:
        nonce = auth.new_nonce()
        s.send(encode(message("hello", nonce=nonce, role=role)))
        ch = _reply(s)
        s.send(encode(message("auth", mac=auth.mac(secret, ch["nonce"], nonce, role))))
        assert _reply(s)["type"] == "welcome"
    return s


def _reply(s: zmq.Socket) -> dict:
    assert s.poll(10_000), "no reply"
    return msgpack.unpackb(s.recv_multipart()[0])


@pytest.mark.slow
@settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invalid_frames(), st.sampled_from([0, 1]), st.sampled_from([None, "coordinator",
                                                                    "upstream"]))
def test_a_live_shard_answers_every_invalid_frame_and_reads_on(live, case, shard, role):
    coord, peers = live
    what, raw, frames = case
    event(f"{what.split(':')[0]} as {role or 'unauthenticated'}")
    s = peers[shard, role]
    while s.poll(0):  # a shard copies other peers' errors to its coordinator: not replies here
        s.recv_multipart()
    s.send_multipart([raw] + [b"\0" * 8] * frames)
    r = _reply(s)
    assert r["type"] == "error" and r["code"] in CODES and r["message"], (what, r)
    s.send(encode(message("ping", sid=1)))  # the next message is read from its start
    r = _reply(s)
    if role == "coordinator":
        assert r["type"] == "pong", (what, r)
    else:
        assert r["code"] == ("unauthenticated" if role is None else "unexpected"), (what, r)
