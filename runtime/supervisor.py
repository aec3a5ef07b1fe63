"""Starting, watching and stopping local shard processes.

Shards are started as fresh interpreters (spawn semantics: no fork of this process, no inherited
state, nothing pickled); the secret travels in the environment, never on the command line. On
CPU devices they are forked, by default, from a fresh interpreter that has imported torch and
the shard's modules once (`runtime.zygote`, `fork_cpu_processes`): ~2.5 s of CPU less each.
Every exit path stops every child, and sweeps shared memory a killed child had not yet handed
over.

A command may start its shard processes before its own imports (`prestart_shards`): each
imports torch and the shard's modules at once and then waits for its arguments and secret on
stdin (one JSON line, `spawn_shard`), so the two processes' imports overlap instead of following
each other (4-5 s each on a GPU host). One that is never given work reads the end of stdin when
its parent closes it or dies, and exits. The draft process is started ahead the same way
(`prestart_draft`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from layersplit.ipc.auth import SECRET_ENV
from layersplit.ipc.shm import sweep
from layersplit.runtime.handover import ARGV_ON_STDIN
from layersplit.runtime.model_store import home
from layersplit.runtime.placement import ShardPlan
from layersplit.runtime.zygote import ForkedProcess, ZygoteError, zygote
from layersplit.shards.compile_cache import ROOT_ENV

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class LocalProcess:
    plan: ShardPlan
    proc: subprocess.Popen | ForkedProcess
    error_file: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def failure(self) -> str | None:
        """A description of why the process is gone, or None while it runs."""
        rc = self.proc.poll()
        if rc is None:
            return None
        how = f"was killed by signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else \
            f"exited with code {rc}"
        text = self.error_text()
        return f"{self.name} (pid {self.pid}) {how}{': ' + text if text else ''}"

    def stopped(self) -> bool:
        """The process is alive but stopped (SIGSTOP, a debugger): it will not answer."""
        try:
            return psutil.Process(self.pid).status() in (psutil.STATUS_STOPPED,
                                                         psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    def error_text(self) -> str:
        """What the process wrote about its failure (before exiting), or ''."""
        try:
            return self.error_file.read_text().strip()
        except OSError:
            return ""

    @property
    def name(self) -> str:
        if self.plan.index < 0:
            return f"the draft process (on {self.plan.device})"
        return f"shard {self.plan.index} (layers {self.plan.layers} on {self.plan.device})"


@dataclasses.dataclass(slots=True)
class Prestarted:
    """A shard (or draft) process started ahead, importing, waiting for its arguments on
    stdin."""

    device: str
    proc: subprocess.Popen
    role: str = "shard"  # "shard" | "draft": the `layersplit` command it will run


def _prestart(role: str, device: str) -> Prestarted | None:
    cmd = [sys.executable, "-m", "layersplit.launch.cli", role, ARGV_ON_STDIN, device]
    try:
        proc = subprocess.Popen(cmd, env=device_env(dict(os.environ), device),
                                stdin=subprocess.PIPE)
    except OSError as e:
        log.warning("could not start a %s process ahead (%s): it starts later", role, e)
        return None
    return Prestarted(device, proc, role)


def prestart_shards(devices: list[str] | tuple[str, ...]) -> list[Prestarted]:
    """One waiting shard process per device (see the module docstring); [] where one cannot
    be started (the coordinator then starts its shards as usual)."""
    out: list[Prestarted] = []
    for device in devices:
        p = _prestart("shard", device)
        if p is None:
            break
        out.append(p)
    return out


def prestart_draft(device: str) -> list[Prestarted]:
    """A waiting draft process for `device` (`spawn_draft` hands it its arguments), in a list
    to add to the shards' ([] where it cannot be started)."""
    p = _prestart("draft", device)
    return [] if p is None else [p]


def drop_prestarted(ready: list[Prestarted]) -> None:
    """Stop the prestarted processes no shard or draft took (before anything was given to
    them)."""
    for p in ready:
        p.proc.kill()
        p.proc.wait()
        with contextlib.suppress(OSError):  # (the pipe of a process that is gone)
            p.proc.stdin.close()
    ready.clear()


def _hand_over(ready: list[Prestarted], device: str, argv: list[str],
               secret: bytes) -> subprocess.Popen | None:
    """Give a prestarted process on `device`, of the role `argv` names, its arguments and
    secret; None if none is left (or the one there died)."""
    for p in list(ready):
        if p.device != device or p.role != argv[0]:
            continue
        ready.remove(p)
        try:
            p.proc.stdin.write(json.dumps({"argv": argv, "secret": secret.hex()}).encode() +
                               b"\n")
            p.proc.stdin.close()
            return p.proc
        except OSError as e:  # (it died while importing: its exit code is not ours to read)
            log.warning("a prestarted %s process is gone (%s): starting another", p.role, e)
            p.proc.kill()
            p.proc.wait()
    return None


def spawn_shard(plan: ShardPlan, listen: str, model: str, dtype: str, threads: int | None,
                secret: bytes, run_dir: Path, seed: int = 0,
                ready: list[Prestarted] | None = None, fork: bool = False,
                weight_format: str = "dequantize") -> LocalProcess:
    """Start a shard process (or hand its arguments to one of `ready`, `prestart_shards`;
    `fork`: a CPU one from the zygote, `runtime.zygote`)."""
    error_file = run_dir / f"shard{plan.index}.error"
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "shard", "--listen", listen,
           "--model", model, "--layers", plan.layers, "--device", plan.device, "--dtype", dtype,
           "--parent-pid", str(os.getpid()), "--index", str(plan.index),
           "--error-file", str(error_file), "--random-seed", str(seed),
           "--weight-format", weight_format]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = _hand_over(ready, plan.device, cmd[3:], secret) if ready else None
    if proc is None:
        proc = _start(cmd, secret, plan.device, fork)
    log.debug("started shard %d (pid %d): %s", plan.index, proc.pid, " ".join(cmd))
    return LocalProcess(plan, proc, error_file)


def compile_cache_env() -> dict[str, str]:
    """The root of the compile caches (torch.compile's (inductor's) and Triton's: kernels and
    autotuning results) under the layersplit home (`$LAYERSPLIT_HOME/compile`, made 0700:
    compiled code is run from there), so that a second start loads the kernels the first one
    compiled instead of compiling them again (the defaults live under /tmp, shared and cleared on
    reboot). Each process picks its key's directory in it (`shards.compile_cache`: versions and
    GPU model). {} where it cannot be made."""
    root = (home() / "compile").resolve()  # (the shard may run from another directory)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if root.stat().st_mode & 0o077:  # made by an older run or by hand: ours, so private
            root.chmod(0o700)
    except OSError as e:
        log.warning("compile caches stay torch's defaults: cannot make %s (%s)", root, e)
        return {}
    # (TRITON_CACHE_AUTOTUNING: the autotuned kernels' choices too, such as fla-core's gated
    # delta rule's, which a hybrid model's first prefill otherwise spends ~35 s choosing anew
    # in every new process)
    return {ROOT_ENV: str(root), "TRITON_CACHE_AUTOTUNING": "1"}


def shard_env(secret: bytes, device: str) -> dict[str, str]:
    """A shard (or draft) process's environment: ours, its secret, and on CUDA the allocator
    and compiler settings (a user's own settings win)."""
    return device_env({**os.environ, SECRET_ENV: secret.hex()}, device)


def device_env(env: dict[str, str], device: str) -> dict[str, str]:
    """`env` with, for a process on a CUDA device, the allocator and compiler settings it
    lacks (a user's own win); where the process starts (a Ray node: its own layersplit home)."""
    if device.startswith("cuda"):
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
        # torch.compile in-process: no pool of compile workers to outlive or slow a shutdown
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        for key, value in compile_cache_env().items():
            env.setdefault(key, value)
    return env


def _start(cmd: list[str], secret: bytes, device: str,
           fork: bool = False) -> subprocess.Popen | ForkedProcess:
    """`cmd` (`python -m layersplit.launch.cli ROLE ... --parent-pid OURS ...`) in a fresh
    interpreter, or for a CPU device with `fork`, forked from the zygote: its parent is then
    the zygote, which it watches instead of us (the zygote ends with us)."""
    if fork and device == "cpu":
        try:
            z = zygote()
            argv = list(cmd[3:])
            argv[argv.index("--parent-pid") + 1] = str(z.proc.pid)
            return z.fork(argv, shard_env(secret, device))
        except ZygoteError as e:
            log.warning("could not fork a %s process (%s): starting a fresh one", cmd[3], e)
    return subprocess.Popen(cmd, env=shard_env(secret, device), stdin=subprocess.DEVNULL)


def draft_argv(draft: str, target: str, device: str, dtype: str, max_context: int,
               threads: int | None, seed: int = 0, block_size: int | None = None,
               graphs: bool = True, compile: bool = True) -> list[str]:
    """`layersplit draft`'s arguments after `--listen ADDRESS` (the same wherever it runs)."""
    argv = ["--draft", draft, "--target", target, "--device", device, "--dtype", dtype,
            "--max-context", str(max_context), "--random-seed", str(seed)]
    if threads:
        argv += ["--threads", str(threads)]
    if block_size:
        argv += ["--block-size", str(block_size)]
    if not graphs:
        argv += ["--no-graphs"]
    if not compile:
        argv += ["--no-compile"]
    return argv


def spawn_draft(listen: str, argv: list[str], device: str, secret: bytes, run_dir: Path,
                ready: list[Prestarted] | None = None, fork: bool = False) -> LocalProcess:
    """The draft process (`draft_argv`), supervised like a shard (`ShardPlan.index` -1 names
    it); handed to a prestarted draft process of `ready` where there is one (`fork`: on CPU,
    forked from the zygote, `spawn_shard`)."""
    error_file = run_dir / "draft.error"
    cmd = [sys.executable, "-m", "layersplit.launch.cli", "draft", "--listen", listen, *argv,
           "--parent-pid", str(os.getpid()), "--error-file", str(error_file)]
    proc = _hand_over(ready, device, cmd[3:], secret) if ready else None
    if proc is None:
        proc = _start(cmd, secret, device, fork)
    log.debug("started the draft process (pid %d): %s", proc.pid, " ".join(cmd))
    return LocalProcess(ShardPlan(-1, 0, 0, device, None), proc, error_file)


def stop_all(procs: list[LocalProcess], grace_s: float = 5.0, term_s: float = 2.0) -> None:
    """Wait for shards to exit (they were asked to), then SIGTERM, then SIGKILL. No orphans."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.proc.poll() is None]
        if not alive:
            break
        if sig == signal.SIGTERM and term_s <= 0:
            continue
        for p in alive:
            log.log(logging.WARNING if grace_s > 0 else logging.DEBUG,
                    "%s still running; sending %s", p.name, sig.name)
            _kill_tree(p.pid, sig)
        for p in alive:
            try:
                p.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        removed = sweep(p.pid)
        if removed:
            log.info("removed shared memory left by %s: %s", p.name, removed)


def _kill_tree(pid: int, sig: signal.Signals) -> None:
    try:
        parent = psutil.Process(pid)
        for child in parent.children(recursive=True):
            child.send_signal(sig)
        parent.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
