"""Supervision: dead or hung shards are noticed fast, nothing is left behind, bad frames are
refused without desynchronizing anything, unauthenticated peers are refused."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time

import msgpack
import psutil
import pytest
import zmq
from layersplit.ipc import auth
from layersplit.ipc.messages import PROTOCOL_VERSION, encode, message, segment
from layersplit.ipc.sockets import connect_dealer
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.placement import PlacementError
from layersplit.shards.sampling import SamplingParams, pack_bias

from tests.helpers import (
    busy_load,
    layersplit_shm,
    run_cli,
    send_raw_step,
    shard_children,
    wait_gone,
)

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


def _cfg(model, n=2, **kw):
    return RuntimeConfig(model=str(model), devices=("cpu",) * n, prefill_chunk=16,
                         max_context=4096, threads=1, **kw)


def _prompt(coord):
    return coord.tokenizer.encode("the cat sat on the mat")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill9_mid_decode_fails_fast_and_cleans_up(tiny_llama, victim):
    """Seen from the process itself, on a loaded machine (twice as many busy loops as cores)."""
    before = layersplit_shm()
    coord = Coordinator(_cfg(tiny_llama, transport=("shm",)))
    coord.start()
    pids = [p.pid for p in coord.procs]
    stream = coord.stream(_prompt(coord), LONG, Progress())
    for _, _ in zip(range(5), stream):
        pass
    with busy_load():
        for _, _ in zip(range(3), stream):  # decoding on the loaded machine
            pass
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ShardFailure) as e:
            for _ in stream:
                pass
        took = time.monotonic() - t0
    assert took < 2.0
    msg = str(e.value)
    assert f"shard {victim}" in msg and "SIGKILL" in msg
    assert wait_gone(pids) == []
    assert layersplit_shm() - before == set()
    with pytest.raises(ShardFailure, match="runtime is down"):
        coord.generate(_prompt(coord), SamplingParams(max_tokens=2))
    coord.close()


@pytest.mark.slow
def test_stopped_shard_is_hung_after_its_step_deadline(tiny_llama):
    """A SIGSTOPped shard answers nothing: the step in flight misses its deadline (sized to
    what decode steps took, at least step_deadline_min) and the run is torn down, naming it."""
    coord = Coordinator(_cfg(tiny_llama, step_deadline_min=1.0))
    coord.start()
    pids = [p.pid for p in coord.procs]
    stream = coord.stream(_prompt(coord), LONG, Progress())
    for _, _ in zip(range(5), stream):  # decode steps have come back: their deadline is known
        pass
    assert coord.deadlines.budget("decode", 1) == 1.0
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(ShardFailure) as e:
        for _ in stream:
            pass
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "missed its deadline of 1.0 s" in msg, msg
    assert "shard 1 (layers 3:6" in msg and "is stopped and hung" in msg, msg
    assert 0.5 < took < 3.0, took  # (the step was sent up to a step's time before the stop)
    assert wait_gone(pids) == []  # the stopped shard gets SIGKILL
    coord.close()


@pytest.mark.slow
def test_slow_shards_on_a_loaded_machine_are_not_torn_down(tiny_llama):
    """A shard that answers nothing for 2.5 s (stopped, then continued) on a loaded machine is
    only slow: no heartbeat tears the run down (a 1 s one did, at load 6.6 on 2 cores), and
    the output is the unloaded one."""
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    with Coordinator(_cfg(tiny_llama, prefix_cache=False)) as coord:
        want = coord.generate(_prompt(coord), p).tokens
        pid = coord.procs[0].pid
        with busy_load():
            stream = coord.stream(_prompt(coord), p, Progress())
            got = [d.token for d in itertools.islice(stream, 4)]
            os.kill(pid, signal.SIGSTOP)
            time.sleep(2.5)
            os.kill(pid, signal.SIGCONT)
            got += [d.token for d in stream if d.token >= 0]  # (not the text tail)
        assert got == want and coord.failed is None


def _run_cli(model, *extra):
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "generate", "the cat",
           "--model", str(model), "--devices", "cpu,cpu", "--threads", "1", "--max-tokens",
           "100000", "--ignore-eos", "--prefill-chunk", "16", *extra]
    # SIGINT as a terminal's foreground job gets it: a run started in the background (`cmd &`
    # in a script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_shards(proc, n=2, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = shard_children(proc.pid)
        if len(kids) == n and proc.stdout.readable():
            return kids
        time.sleep(0.1)
    raise AssertionError("shards did not start")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_coordinator_signal_exits_cleanly(tiny_llama, sig):
    before = layersplit_shm()
    # a context of 32768 tokens: the generation runs for minutes, it cannot end before the
    # signal (with 4096 it once did, and the run exited 0)
    proc = _run_cli(tiny_llama, "--max-context", "32768")
    kids = _wait_for_shards(proc)
    assert proc.stdout.read(1)  # generated text streams: the generation is under way
    assert proc.poll() is None
    proc.send_signal(sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # where it hangs (every thread's stack), and nothing left
        proc.send_signal(signal.SIGUSR1)  # (`launch.cli` prints the stacks on SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        for k in kids:
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        pytest.fail(f"no exit 20 s after signal {sig}; its stderr:\n{proc.stderr.read()[-6000:]}")
    assert proc.returncode in (128 + sig, 130, 1), proc.stderr.read()
    assert wait_gone([k.pid for k in kids]) == []
    assert layersplit_shm() - before == set()


@pytest.mark.slow
def test_coordinator_kill9_orphans_exit(tiny_llama):
    before = layersplit_shm()
    proc = _run_cli(tiny_llama)
    kids = _wait_for_shards(proc)
    proc.stdout.read(20)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone([k.pid for k in kids], timeout=5) == []
    assert layersplit_shm() - before == set()


# ---- bad frames ------------------------------------------------------------------------------
def _peer(address, secret=None, role="upstream", channel=None):
    """A raw peer; `channel`: the run's secret, to open the tcp:// edge's encrypted channel
    (`ipc.curve`) without the HMAC handshake that `secret` then performs."""
    s = connect_dealer(zmq.Context.instance(), address, channel or secret or b"")
    if secret is not None:
        nonce = auth.new_nonce()
        s.send(encode(message("hello", nonce=nonce, role=role)))
        assert s.poll(5000)
        ch = msgpack.unpackb(s.recv())
        s.send(encode(message("auth", mac=auth.mac(secret, ch["nonce"], nonce, role))))
        assert s.poll(5000)
        assert msgpack.unpackb(s.recv())["type"] == "welcome"
    return s


def _reply(s):
    assert s.poll(5000), "no reply"
    return msgpack.unpackb(s.recv_multipart()[0])


@pytest.mark.slow
def test_garbage_frames_get_errors_and_the_runtime_keeps_working(tiny_llama):
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    with Coordinator(_cfg(tiny_llama, n=3, local_addresses="tcp")) as coord:
        prompt = _prompt(coord)
        want = coord.generate(prompt, p).tokens
        for sh in coord.shards:
            # unauthenticated garbage, not msgpack
            s = _peer(sh.address, channel=coord.secret)
            s.send(b"\xc1\xff garbage")
            r = _reply(s)
            assert r["type"] == "error" and r["code"] == "malformed"
            # unauthenticated but well-formed: refused
            s.send(encode(message("configure", session=b"x", next=None, max_context=8,
                                  max_step_tokens=1, slots=1, transport="zmq", kv_block=16,
                                  kv_blocks=1)))
            r = _reply(s)
            assert r["type"] == "error" and r["code"] == "unauthenticated"
            # authenticated peer: garbage, unknown type, wrong field type, oversized, bad frames
            a = _peer(sh.address, coord.secret)
            a.send(b"\x93\x01\x02")
            assert _reply(a)["code"] == "malformed"
            a.send(encode({"type": "teleport", "v": PROTOCOL_VERSION}))
            assert _reply(a)["code"] == "unknown_type"
            a.send(encode({"type": "step", "v": PROTOCOL_VERSION, "sid": "one"}))
            assert "field" in _reply(a)["message"]
            a.send(encode({"type": "ping", "v": PROTOCOL_VERSION, "pad": b"x" * (2 << 20)}))
            assert _reply(a)["code"] == "oversized"
            a.send_multipart([encode(message("step", sid=1, seqs=[segment(0, 0, 1)],
                                             act={"kind": "zmq"})),
                              b"1234", b"5678", b"9", b"0", b"1"])
            assert _reply(a)["type"] == "error"
            a.send(encode(message("step", sid=1, seqs=[segment(0, 0, 1)],
                                  act={"kind": "zmq", "dtype": "float32", "shape": [1, 64]})))
            assert _reply(a)["code"] == "unexpected"  # not the linked upstream
            a.close()
            s.close()
            # garbage on the coordinator's own control channel
            sh.sock.send(b"\xc1 not msgpack")
        assert coord.generate(prompt, p).tokens == want  # stale error replies are discarded


@pytest.mark.slow
def test_wrong_secret_is_refused(tiny_llama):
    with Coordinator(_cfg(tiny_llama, n=1, local_addresses="tcp")) as coord:
        s = _peer(coord.shards[0].address, channel=coord.secret)
        nonce = auth.new_nonce()
        s.send(encode(message("hello", nonce=nonce, role="coordinator")))
        ch = _reply(s)
        s.send(encode(message("auth", mac=auth.mac(b"wrong", ch["nonce"], nonce, "coordinator"))))
        r = _reply(s)
        assert r["type"] == "error" and "authentication failed" in r["message"]
        s.send(encode(message("shutdown")))
        assert _reply(s)["code"] == "unauthenticated"
        s.close()
        # without the secret the encrypted channel never opens: not even a hello is read
        s = _peer(coord.shards[0].address, channel=b"wrong")
        s.send(encode(message("hello", nonce=auth.new_nonce(), role="coordinator")))
        assert not s.poll(2000)
        s.close()
        assert coord.generate(_prompt(coord), SamplingParams(max_tokens=2)).tokens
        out = coord.generate(_prompt(coord), SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.tokens) == 3


# ---- invalid placements -----------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    ({"layers": ("0:4", "3:6")}, "overlap"),
    ({"layers": ("0:3", "4:6")}, "layers 3:4 are not covered"),
    ({"layers": ("0:3", "3:5")}, "layers 5:6 are not covered"),
    ({"split": (3, 2)}, "adds up to 5"),
    ({"split": (6, 0)}, "at least 1 layer"),
    ({"devices": ("cpu",) * 7}, "only 6 layers"),
    ({"devices": ("cpu", "tpu:0")}, "unknown device 'tpu:0'"),
    ({"devices": ("cpu", "cuda:7")}, "cuda:7 does not exist"),
    ({"transport": ("cuda-ipc",)}, "cuda-ipc needs two CUDA devices"),
    ({"transport": ("carrier-pigeon",)}, "unknown"),
    ({"split": (3, 3), "weights": (1.0, 1.0)}, "only one of"),
])
def test_invalid_placement_rejected_before_any_process(tiny_llama, kw, match):
    kw = {"devices": ("cpu", "cpu"), **kw}
    with pytest.raises(PlacementError, match=match):
        Coordinator(RuntimeConfig(model=str(tiny_llama), **kw))
    assert shard_children() == []


@pytest.mark.slow
def test_invalid_placement_cli_exit_code(tiny_llama):
    r = run_cli("generate", "hi", "--model", str(tiny_llama), "--layers", "0:4,3:6")
    assert r.returncode == 2 and "overlap" in r.stderr
    r = run_cli("generate", "hi", "--model", str(tiny_llama), "--max-context", "many")
    assert r.returncode == 2 and "max_context='many'" in r.stderr


def test_psutil_sees_no_leftovers():
    assert shard_children() == []


@pytest.mark.slow
def test_bad_segments_are_refused_by_name_and_the_batch_goes_on(tiny_llama):
    """Steps whose segments cannot be right, sent where real steps go (the first shard's ring):
    each gets an error naming what is wrong, before any compute; later requests are unchanged."""
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    with Coordinator(_cfg(tiny_llama, n=2, max_seqs=3)) as coord:
        prompt = _prompt(coord)
        want = coord.generate(prompt, p).tokens
        greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
        asking = {"n": 3, "tree": 0, "after": 1}
        cases = [
            ([segment(3, 0, 1)], [5], "slot 3 is outside 0..2"),
            ([segment(1, 0, 1), segment(1, 4, 1)], [5, 6], "slot 1 is outside 0..2 or repeated"),
            ([segment(0, 4090, 8)], [5] * 8, "n=8 pos=4090 outside a context of 4096"),
            ([segment(0, 0, 2)], [5], "expected 2 int64 token ids"),
            ([segment(0, 0, 1, {**greedy, "temperature": -1.0})], [5],
             "temperature must be >= 0"),
            ([segment(0, 0, 1, {**greedy, "top_p": "all"})], [5], "'top_p' must be a number"),
            ([segment(0, 0, 2, greedy, draft=[9999])], [5, 6], "draft token ids"),
            ([segment(0, 0, 1, {**greedy, "bias": pack_bias([9999], [1.0])})], [5],
             "bias names a token id outside the vocabulary"),
            ([segment(0, 0, 1, {**greedy, "mask": b"junk"})], [5], "mask is not zlib data"),
            ([segment(0, 0, 1, {**greedy, "lp": -2})], [5], "lp=-2 must be an integer"),
            ([segment(0, 4, 2, {**greedy, "bias": pack_bias([1], [1.0])}, draft=[5])], [5, 6],
             "logits processors (bias, rep, mask) apply to decode and prefill segments only"),
            ([segment(0, 0, 2, greedy, plp={"targets": [1, 2, 3], "k": 1, "temperature": 0})],
             [5, 6], "plp={'targets': [1, 2, 3]"),
            ([segment(0, 0, 1, feat=-1)], [5], "draft context -1 is negative"),
            ([segment(0, 4, 3, greedy, draft=[5, 6], tree=[0, 2])], [5, 6, 7],
             "tree node 2: parent 2 is not on the path"),
            ([segment(0, 4, 1, greedy, tree=[0])], [5], "a token tree without draft tokens"),
            ([segment(0, 4, 1, greedy, q=[None])], [5], "q without draft tokens"),
            ([segment(0, 4, 3, greedy, draft=[5, 6], q=[b"junk", None, None])], [5, 6, 7],
             "q[0]: not up to 32 packed (id, probability) pairs"),
            ([segment(0, 4, 3, greedy, draft=[5, 6], then={"n": -1, "tree": 0})], [5, 6, 7],
             "not a verify segment's next proposal"),
            ([segment(0, 4, 1, greedy, then={"n": 3, "tree": 0})], [5],
             "not a verify segment's next proposal"),
            ([segment(0, 4, 1, greedy, kept=[2, 1])], [5],
             "kept tree rows [2, 1] before position 4"),
            ([segment(0, 4, 1, greedy, prev=1)], [5],
             "prev=1, but slot 0's last sampled token came from step"),
            ([segment(0, 4, 1, greedy, prev=10 ** 9)], [5], "is not an earlier step than"),
            ([segment(0, 4094, 1, greedy, kept=[9])], [5], "kept rows reach past the context"),
            ([segment(0, 4, 1, greedy, feat=0, ask={"n": 3, "tree": 0})], [5],
             "needs n, tree and after, integers >= 0"),
            ([segment(0, 4, 1, greedy, ask={"n": 3, "tree": 0, "after": 1})], [5],
             "needs the sequence's draft context"),
            ([segment(0, 4, 2, greedy, feat=0, ask={"n": 3, "tree": 0, "after": 1})], [5, 6],
             "must be one row with none of its own"),
            # a step to hold for the draft's tokens is checked whole before its kept rows move
            ([segment(0, 4, 1, greedy, feat=0, kept=[1], ask=asking)], [10 ** 6],
             "token id outside the vocabulary"),
            ([segment(0, 4, 1, greedy, feat=0, kept=[1], ask=asking),
              segment(0, 6, 1, greedy, feat=0, kept=[1], ask=asking)], [5, 6],
             "slot 0 is outside 0..2 or repeated"),
        ]
        cases = [(seqs, ids, why, {}) for seqs, ids, why in cases] + [
            ([segment(0, 4, 1, greedy, feat=0)], [5], "park=yes (true parks", {"park": "yes"}),
            ([segment(0, 4, 2, greedy, feat=0, draft=[5])], [5, 6], "park=True (true parks",
             {"park": True})]
        for seqs, ids, why, extra in cases:
            sid = send_raw_step(coord, seqs, ids, **extra)
            with pytest.raises(ShardFailure, match=re.escape(why)):
                coord._wait(lambda s, m: False, time.monotonic() + 30, f"step {sid}", sid)
            assert coord.failed is None
        assert coord.generate(prompt, p).tokens == want
        got = coord.generate_batch([prompt] * 3, [p] * 3)
        assert [r.tokens for r in got] == [want] * 3
