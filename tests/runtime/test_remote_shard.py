"""A shard started by hand (`layersplit shard --listen tcp://...`) joins a coordinator's chain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ipc.sockets import free_tcp_port
from runtime.config import RuntimeConfig
from runtime.coordinator import Coordinator, ShardFailure
from runtime.generate import Progress
from runtime.reference import ReferenceEngine
from shards.sampling import SamplingParams
from tests.helpers import wait_gone

SECRET = "a3" * 32


@pytest.fixture
def remote_process(tiny_llama):
    port = free_tcp_port()
    env = {**os.environ, "LAYERSPLIT_SECRET": SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "shard", "--listen", f"tcp://127.0.0.1:{port}",
         "--model", str(tiny_llama), "--layers", "3:6", "--threads", "1"], env=env)
    yield f"tcp://127.0.0.1:{port}", proc
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def remote_shard(remote_process):
    return remote_process[0]


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
def test_silent_remote_shard_is_lost_after_heartbeat_timeout(tiny_llama, remote_process,
                                                             monkeypatch):
    """Remote shards are watched by zmq heartbeats, with the configured timeout."""
    monkeypatch.setenv("LAYERSPLIT_SECRET", SECRET)
    address, proc = remote_process
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


def test_remote_shards_need_a_secret(tiny_llama, monkeypatch):
    monkeypatch.delenv("LAYERSPLIT_SECRET", raising=False)
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"),
                        shard_addresses=("", "tcp://127.0.0.1:1"))
    with pytest.raises(ShardFailure, match="shared secret"):
        Coordinator(cfg).start()


def test_shard_cli_needs_a_secret(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "LAYERSPLIT_SECRET"}
    r = subprocess.run([sys.executable, "-m", "launch.cli", "shard", "--listen",
                        "tcp://127.0.0.1:1", "--model", str(tiny_llama), "--layers", "0:3"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "shared secret" in r.stderr
    assert wait_gone([]) == []
