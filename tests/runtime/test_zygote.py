"""CPU shard and draft processes forked from the zygote (`runtime.zygote`): a real zygote, real
shard processes. What they print reaches our stdout and stderr, their end is reported like a
`Popen`'s, the secret never sits in the zygote's environment, a bad request is refused by name,
a zygote that dies is replaced and its children stop, and a forked chain gives the tokens and
logits of a spawned one."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import psutil
import pytest
from layersplit.ipc.auth import SECRET_ENV
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.generate import Progress, collect
from layersplit.runtime.placement import ShardPlan
from layersplit.runtime.supervisor import spawn_shard
from layersplit.runtime.zygote import ForkedProcess, ZygoteError, zygote
from layersplit.shards.sampling import SamplingParams

from tests.helpers import shard_children, wait_gone


def _shard(tmp_path, model, **kw):
    plan = ShardPlan(0, 0, 2, "cpu", None)
    return spawn_shard(plan, f"ipc://{tmp_path}/s.sock", str(model), "float32", 1, b"k" * 32,
                       tmp_path, fork=True, **kw)


def test_a_forked_shard_is_ours_to_watch_signal_and_wait_for(tmp_path, tiny_llama,
                                                             monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)  # (ours: never the zygote's)
    monkeypatch.chdir(tmp_path)
    p = _shard(tmp_path, tiny_llama)
    assert isinstance(p.proc, ForkedProcess)
    z = zygote()
    assert psutil.Process(p.pid).ppid() == z.proc.pid
    assert p.exit_code() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.proc.wait(0.2)
    assert psutil.Process(p.pid).cwd() == str(tmp_path)  # (ours, as a spawned one's)
    assert [k.pid for k in shard_children()] == [p.pid]
    with open(f"/proc/{z.proc.pid}/environ", "rb") as f:  # (the child's secret came over
        assert SECRET_ENV.encode() not in f.read()  # the channel, never the zygote's)
    p.proc.send_signal(signal.SIGKILL)
    assert p.proc.wait(5) == -signal.SIGKILL
    assert "killed by signal 9 (SIGKILL)" in p.failure()
    assert shard_children() == []


def test_a_failing_child_writes_to_our_stderr_and_reports_its_code(tmp_path, capfd):
    p = _shard(tmp_path, tmp_path / "no-such-model")
    assert p.proc.wait(30) == 2
    err = capfd.readouterr().err
    assert "no-such-model" in err
    assert "exited with code 2" in p.failure()


def test_a_bad_request_is_refused_by_name():
    with pytest.raises(ZygoteError, match="shard or draft command"):
        zygote().fork(["generate", "hi"], {})
    with pytest.raises(ZygoteError, match="shard or draft command"):
        zygote().fork(["shard", 3], {})  # type: ignore[list-item]
    assert zygote().alive()  # (refused, not fallen over)


@pytest.mark.slow
def test_a_dead_zygote_is_replaced_and_its_children_stop(tmp_path, tiny_llama):
    p = _shard(tmp_path, tiny_llama)
    old = zygote()
    old.proc.kill()
    old.proc.wait()
    assert wait_gone([p.pid], 10) == []  # (its parent changed: `watch_parent`)
    # (its main thread is a zombie first; its pidfd says it ended once every thread has)
    deadline = time.monotonic() + 10
    while p.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.exit_code() is not None
    new = zygote()
    assert new is not old and new.alive()
    q = _shard(tmp_path, tiny_llama)
    assert psutil.Process(q.pid).ppid() == new.proc.pid
    q.proc.kill()
    q.proc.wait(5)
    # its channel closed (our exit), the zygote ends, cleanly (by os._exit, without tearing
    # down an interpreter that imported torch, ~0.5 s of a core; not timed here)
    new.close()
    assert new.proc.returncode == 0


@pytest.mark.slow
def test_forked_and_spawned_chains_give_the_same_logits(tiny_llama):
    got = {}
    for fork in (True, False):
        cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu", "cpu"), threads=1,
                            max_context=64, prefix_cache=False, draft="none",
                            fork_cpu_processes=fork)
        with Coordinator(cfg) as c:
            parents = {psutil.Process(p.pid).ppid() for p in c.procs}
            assert parents == ({zygote().proc.pid} if fork else {os.getpid()})
            progress = Progress(logits=[])
            out = collect(c.stream(list(range(3, 30)), SamplingParams(max_tokens=6,
                                                                       ignore_eos=True),
                                   progress), progress, 27)
        got[fork] = (out.tokens, np.stack(progress.logits))
    assert got[True][0] == got[False][0]
    np.testing.assert_array_equal(got[True][1], got[False][1])
    assert shard_children() == []


def test_a_process_forked_from_ours_leaves_our_children_alone(tmp_path, tiny_llama):
    """An application that forks after starting shards: the fork's copies of them say they
    ended (as a copied Popen does) and send no signal, so its cleanup stops nothing of ours."""
    p = _shard(tmp_path, tiny_llama)
    pid = os.fork()
    if pid == 0:  # (the child: only this, then out)
        code = 0
        try:
            p.proc.kill()
            if p.proc.poll() != 0 or p.proc.wait(1) != 0:
                code = 1
        except BaseException:  # noqa: BLE001 - the child's verdict is its exit code
            code = 2
        os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert p.exit_code() is None and psutil.pid_exists(p.pid)  # (ours runs on)
    p.proc.kill()
    assert p.proc.wait(5) == -signal.SIGKILL
