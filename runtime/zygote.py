"""CPU shard and draft processes forked from one process that has imported torch already.

A fresh interpreter spends ~2.5 s of CPU importing torch and the shard's modules before it
can load a layer; a coordinator on CPU devices (development, CI, a machine without GPUs)
starts two or three of them, and a test suite hundreds. The zygote is a fresh interpreter,
started once per parent process (`zygote()`), that does those imports once and then forks a
child per `layersplit shard` or `layersplit draft` command it is handed: the child starts with
everything imported, in ~20 ms.

What a child inherits is only that import state: nothing of the parent (the zygote is spawned,
never forked from it, and holds no thread, no socket but its own channel, no torch thread pool
and no device context when it forks); the command's arguments and environment (its secret
included) come over the channel, as JSON, and the parent's standard output and error as file
descriptors (SCM_RIGHTS), so a child writes where a spawned one would. Never pickle.

The channel is a socketpair private to the parent and the zygote. The parent sends one JSON
line per child, `{"argv": [...], "env": {...}}`, with its fds 1 and 2; the zygote answers
`{"pid": N}` (or `{"error": "..."}`), and reports each child's end, `{"exit": N, "rc": C}`
(`subprocess.Popen.returncode`'s meaning: -signal when killed). `ForkedProcess` gives the
parent a `Popen`'s methods over that. A zygote whose parent goes away reads the end of its
channel and exits; its children then see their parent change (`shards.worker.watch_parent`,
given the zygote's pid) and stop. Only CPU devices: a CUDA process is started fresh
(`runtime.supervisor`; `fork_cpu_processes = false` starts CPU ones fresh too).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)
MAX_LINE = 1 << 20  # a request's JSON line (arguments and environment)
REAP_S = 0.02  # how often the zygote looks for children that ended
FORK_WAIT_S = 120.0  # for the zygote's answer (its imports first, when it has just started)


class ZygoteError(RuntimeError):
    """The zygote could not fork a child (the caller starts a fresh interpreter)."""


class ForkedProcess:
    """A child of the zygote, with the parts of `subprocess.Popen` the supervisor uses."""

    stdin = None

    def __init__(self, pid: int, args: list[str], owner: Zygote) -> None:
        self.pid, self.args, self._owner = pid, args, owner
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._owner.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            rc = self._owner.wait_exit(self.pid, timeout)
            if rc is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = rc
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The parent's side: the zygote process, its channel and what it reported."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layersplit.runtime.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = mine
        self.lock = threading.Lock()  # one request at a time
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.replies: list[dict] = []
        self.gone = False
        self.reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    with self.cond:
                        if "exit" in msg:
                            self.exits[int(msg["exit"])] = int(msg["rc"])
                        else:
                            self.replies.append(msg)
                        self.cond.notify_all()
        except (OSError, ValueError) as e:
            log.warning("the zygote's channel failed: %s", e)
        with self.cond:
            self.gone = True
            self.cond.notify_all()

    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """A child running `layersplit ARGV` with the environment `env` (ZygoteError when the
        zygote is gone or says why it could not)."""
        line = json.dumps({"argv": argv, "env": env}).encode() + b"\n"
        if len(line) > MAX_LINE:
            raise ZygoteError(f"a request of {len(line)} bytes (at most {MAX_LINE})")
        with self.lock:
            for out in (sys.stdout, sys.stderr):  # (what we wrote goes first)
                with contextlib.suppress(Exception):
                    out.flush()
            try:
                socket.send_fds(self.sock, [line], [1, 2])
            except OSError as e:
                raise ZygoteError(f"the zygote is gone ({e})") from None
            with self.cond:
                self.cond.wait_for(lambda: self.replies or self.gone, FORK_WAIT_S)
                if not self.replies:
                    raise ZygoteError("the zygote is gone" if self.gone else
                                      f"no answer from the zygote in {FORK_WAIT_S:.0f} s")
                reply = self.replies.pop(0)
        if "pid" not in reply:
            raise ZygoteError(str(reply.get("error", reply)))
        return ForkedProcess(int(reply["pid"]), ["layersplit", *argv], self)

    def exit_code(self, pid: int) -> int | None:
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
            if not self.gone:
                return None
        # the zygote is gone: the child was handed to init, which reaps it; its code is lost
        return None if _running(pid) else -signal.SIGKILL

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while pid not in self.exits and not self.gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left)
        while True:
            rc = self.exit_code(pid)
            if rc is not None or (deadline is not None and time.monotonic() >= deadline):
                return rc
            time.sleep(0.01)

    def close(self) -> None:
        """The zygote exits (at the channel's end); children already forked run on until their
        parent changes (`watch_parent`), which is then."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_lock = threading.Lock()
_zygote: Zygote | None = None


def zygote() -> Zygote:
    """This process's zygote, started on first use (and again if it died); it ends with this
    process."""
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is not None:
                log.warning("the zygote (pid %d) is gone: starting another", _zygote.proc.pid)
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


# ---- the zygote process ------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    """Fork a child per request until the channel ends; report each child's end."""
    buf, fds = b"", []
    while True:
        ready, _, _ = select.select([sock], [], [], REAP_S)
        _reap(sock)
        if not ready:
            continue
        data, got, _, _ = socket.recv_fds(sock, 65536, 2)
        if not data:
            for fd in got:
                os.close(fd)
            return
        buf += data
        fds += got
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            mine, fds = fds[:2], fds[2:]
            try:
                req = json.loads(line)
                argv, env = req["argv"], req["env"]
                if len(mine) != 2 or not (isinstance(argv, list) and argv[:1] in (["shard"],
                                                                                   ["draft"])
                                          and all(isinstance(a, str) for a in argv)) or \
                        not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(
                            v, str) for k, v in env.items())):
                    raise ValueError("expected a shard or draft command's arguments, its "
                                     "environment and two file descriptors")
                pid = os.fork()
                if pid == 0:
                    _child(sock, argv, env, mine)
                reply = {"pid": pid}
            except (ValueError, KeyError, TypeError, OSError) as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
            for fd in mine:
                os.close(fd)
            sock.sendall(json.dumps(reply).encode() + b"\n")


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
                         .encode() + b"\n")


def _child(sock: socket.socket, argv: list[str], env: dict[str, str], fds: list[int]) -> None:
    """In the forked child: the parent's stdio and the command's environment, then the
    command, which never returns (`launch.cli`: shard and draft processes end in os._exit)."""
    code = 1
    try:
        sock.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _name(f"layersplit-{argv[0]}")
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["layersplit", *argv]
        from layersplit.launch.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child's error, to its stderr
        import traceback

        traceback.print_exc()
    finally:
        for out in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                out.flush()
        os._exit(code)


def _name(name: str) -> None:
    """The process's name in top and `ps -o comm` (its command line stays the zygote's)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # (PR_SET_NAME)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is the parent's to handle)
    # what every child needs, imported once here (no thread, no device context: safe to fork)
    import layersplit.draft.server
    import layersplit.launch.cli
    import layersplit.shards.worker  # noqa: F401

    _serve(sock)


if __name__ == "__main__":
    main()
