"""A shard started by hand (`layersplit shard --listen tcp://...`) joins a coordinator's chain."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from layersplit.ipc.sockets import free_tcp_port
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import wait_gone

SECRET = "a3" * 32


@contextlib.contextmanager
def _started_by_hand(model) -> Iterator[tuple[str, subprocess.Popen]]:
    """`layersplit shard --listen tcp://...` for layers 3:6: its address and process."""
    port = free_tcp_port()
    env = {**os.environ, "LAYERSPLIT_SECRET": SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "layersplit.launch.cli", "shard", "--listen", f"tcp://127.0.0.1:{port}",
         "--model", str(model), "--layers", "3:6", "--threads", "1"], env=env)
    try:
        yield f"tcp://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def shared_remote(tiny_llama):
    """One shard started by hand for the module's tests (its start, a fresh interpreter, is
    most of a test's time)."""
    with _started_by_hand(tiny_llama) as started:
        yield started


@pytest.fixture
def remote_shard(shared_remote):
    """The module's shard: it serves one test's coordinators after another's, as a remote
    shard outlives its coordinator (a wrong secret, a changed byte or a restart before leaves
    it serving); it is still up after the test."""
    address, proc = shared_remote
    yield address
    assert proc.poll() is None, f"the remote shard exited ({proc.returncode})"


@pytest.mark.slow
def test_remote_shard_joins_and_matches_reference(tiny_llama, remote_shard, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", remote_shard), prefill_chunk=16, threads=1,
                        max_context=256)
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("remote shards work over tcp " * 3)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    with Coordinator(cfg) as coord:
        # "remote" here is the same host, which the shards notice: auto picks shared memory
        assert coord.shard_info()[0]["transport_out"] == "shm"
        assert coord.generate(prompt, p).tokens == ref.generate(prompt, p).tokens
    # the remote shard outlives its coordinator and serves the next one, here over zmq/tcp
    with Coordinator(cfg.replace(transport=("zmq",))) as coord:
        assert coord.shard_info()[0]["transport_out"] == "zmq"
        assert coord.generate(prompt, p).tokens == ref.generate(prompt, p).tokens


@pytest.mark.slow
def test_remote_shard_refuses_a_wrong_secret(tiny_llama, remote_shard, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SECRET", "b4" * 32)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", remote_shard), threads=1, startup_timeout=30)
    with pytest.raises(ShardFailure, match="authentication failed"):
        Coordinator(cfg).start()


@pytest.mark.slow
def test_remote_shard_with_other_layers_is_named(tiny_llama, remote_shard, monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(2, 4),
                        shard_addresses=("", remote_shard), threads=1, startup_timeout=30)
    with pytest.raises(ShardFailure, match="start it with --layers 2:6"):
        Coordinator(cfg).start()


@pytest.mark.slow
def test_remote_shard_with_another_dtype_is_named(tiny_llama, remote_shard, monkeypatch):
    """The shard was started without --dtype (float32); a bfloat16 run refuses it by name
    instead of computing half the chain in another dtype."""
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", remote_shard), threads=1, startup_timeout=30,
                        dtype="bfloat16")
    with pytest.raises(ShardFailure, match="computes in float32 where this run computes in "
                                           "bfloat16: start it with --dtype bfloat16"):
        Coordinator(cfg).start()


def test_remote_shards_need_a_secret(tiny_llama, monkeypatch):
    monkeypatch.delenv("LAYERSPLIT_SECRET", raising=False)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"),
                        shard_addresses=("", "tcp://127.0.0.1:1"))
    with pytest.raises(ShardFailure, match="shared secret"):
        Coordinator(cfg).start()


@pytest.mark.slow
def test_shard_cli_needs_a_secret(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "LAYERSPLIT_SECRET"}
    r = subprocess.run([sys.executable, "-m", "layersplit.launch.cli", "shard", "--listen",
                        "tcp://127.0.0.1:1", "--model", str(tiny_llama), "--layers", "0:3"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "shared secret" in r.stderr
    assert wait_gone([]) == []


class Relay:
    """A man in the middle on loopback: forwards TCP both ways to `target`, and with `flip_at`
    changes one byte of each client-to-server stream at that offset."""

    def __init__(self, target: str, flip_at: int | None) -> None:
        import socket
        import threading

        self.host, self.port = "127.0.0.1", free_tcp_port()
        self.target = target[len("tcp://"):].rsplit(":", 1)
        self.flip_at, self.flipped = flip_at, 0
        self.server = socket.create_server((self.host, self.port))
        self.server.settimeout(0.2)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _accept(self) -> None:
        import socket
        import threading

        while not self.stop.is_set():
            try:
                client, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:  # closed
                return
            upstream = None
            for _ in range(300):  # the shard may still be loading: retry as zmq would
                try:
                    upstream = socket.create_connection((self.target[0], int(self.target[1])))
                    break
                except ConnectionRefusedError:
                    time.sleep(0.1)
            if upstream is None:
                client.close()
                continue
            for a, b, flip in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pipe, args=(a, b, flip), daemon=True)
                t.start()
                self.threads.append(t)

    def _pipe(self, src, dst, flip: bool) -> None:
        seen = 0
        try:
            src.settimeout(0.2)
        except OSError:  # (the other direction's thread ended first and closed both sockets)
            return
        while not self.stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if flip and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                i = self.flip_at - seen
                data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
                self.flipped += 1
            seen += len(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.server.close()


@pytest.mark.slow
@pytest.mark.parametrize("flip_at", [None, 150, 900])
def test_a_byte_changed_on_the_wire_is_refused(tiny_llama, remote_shard, monkeypatch, flip_at):
    """Every tcp:// edge is encrypted and authenticated (`ipc.curve`): a relay that changes one
    byte, in the handshake (150) or in a message after it (900), breaks the chain with a clear
    error, never a wrong token; the same relay passing bytes unchanged serves exact output."""
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    relay = Relay(remote_shard, flip_at)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", relay.address), transport=("zmq",),
                        prefill_chunk=16, threads=1, max_context=256, startup_timeout=30)
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("a relay sits on the wire " * 3)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    try:
        if flip_at is None:
            with Coordinator(cfg) as coord:
                assert coord.generate(prompt, p).tokens == ref.generate(prompt, p).tokens
            return
        with pytest.raises(ShardFailure):
            with Coordinator(cfg) as coord:
                coord.generate(prompt, p)
        assert relay.flipped > 0
    finally:
        relay.close()


@pytest.mark.slow
def test_remote_shard_cache_travels_over_its_channel(tiny_llama, remote_shard, monkeypatch,
                                                     tmp_path):
    """A shard started by hand may not see the coordinator's cache directory: its tensors are
    sent to the coordinator, written once into the one file there, and sent back on restore.
    The entry restores after a restart, and into a split of local shards, bit for bit."""
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", remote_shard), prefill_chunk=16, threads=1,
                        max_context=256, kv_cache_dir=str(tmp_path))
    ref = ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=256)
    prompt = ref.tokenizer.encode("the cache crosses hosts " * 4)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    want = ref.generate(prompt, p).tokens
    with Coordinator(cfg) as coord:
        assert coord.shards[1].streams_cache and not coord.shards[0].streams_cache
        assert coord.generate(prompt, p).tokens == want
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files  # written by the coordinator, with the remote shard's tensors in them
    with Coordinator(cfg) as coord:  # a restart: the remote shard is sent its rows
        r = coord.generate(prompt, p)
        assert (r.cache_tier, r.cached_tokens, r.tokens) == ("disk", len(prompt), want)
    local = cfg.replace(shard_addresses=(), split=(2, 4))
    with Coordinator(local) as coord:  # and local shards read what the remote one sent
        r = coord.generate(prompt, p)
        assert (r.cache_tier, r.tokens) == ("disk", want)


@pytest.mark.slow
def test_silent_remote_shard_is_lost_after_heartbeat_timeout(tiny_llama, shared_remote,
                                                             monkeypatch):
    """Remote shards are watched by zmq heartbeats, with the configured timeout. (The
    module's shard, stopped here for good: the module's last test.)"""
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    address, proc = shared_remote
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), split=(3, 3),
                        shard_addresses=("", address), prefill_chunk=16, threads=1,
                        max_context=4096, heartbeat_timeout=1.0)
    with Coordinator(cfg) as coord:
        stream = coord.stream(coord.tokenizer.encode("the cat sat"),
                              SamplingParams(max_tokens=100_000, ignore_eos=True), Progress())
        next(stream)
        proc.send_signal(signal.SIGSTOP)  # silent, its sockets open: only heartbeats tell
        t0 = time.monotonic()
        with pytest.raises(ShardFailure, match=r"shard 1 at tcp://.*unanswered for 1.0 s"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 3.0
