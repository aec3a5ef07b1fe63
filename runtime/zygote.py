"""CPU shard and draft processes forked from one process that has imported torch already.

A fresh interpreter spends ~2.5 s of CPU importing torch and the shard's modules before it
can load a layer; a coordinator on CPU devices (development, CI, a machine without GPUs)
starts two or three of them, and a test suite hundreds. The zygote is a fresh interpreter,
started once per parent process (`zygote()`), that does those imports once and then forks a
child per `layersplit shard` or `layersplit draft` command it is handed: the child starts with
everything imported, in ~20 ms.

What a child inherits is only that import state: nothing of the parent (the zygote is spawned,
never forked from it, with the parent's environment less its secret; when it forks it holds no
thread of its own, no socket but its channel, no torch thread pool and no device context); the
command's arguments, environment (its secret included) and working directory come over the
channel, as JSON, and the parent's standard output and error as file descriptors (SCM_RIGHTS),
so a child writes where a spawned one would. Nothing is pickled. What the zygote's imports read once
(a module-level setting of the environment, `sys.path`, the umask) is as it was when the
zygote started: the first CPU shard of the process.

The channel is a socketpair private to the parent and the zygote. The parent sends one JSON
line per child, `{"id": SERIAL, "argv": [...], "env": {...}, "cwd": DIR}`, with its fds 1 and
2; the zygote answers `{"id": SERIAL, "pid": N}` (or `{"id": SERIAL, "error": "..."}`), and
reports each child's end, `{"exit": N, "rc": C}` (`subprocess.Popen.returncode`'s meaning:
-signal when killed). `ForkedProcess` gives the
parent a `Popen`'s methods over that. A zygote whose parent goes away reads the end of its
channel and exits; its children then see their parent change (`ipc.parent_watch.watch_parent`,
given the zygote's pid) and stop. Only CPU devices: a CUDA process is started fresh
(`runtime.supervisor`; `fork_cpu_processes = false` starts CPU ones fresh too).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
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
import warnings
import weakref

import psutil
from layersplit.ipc.auth import SECRET_ENV

log = logging.getLogger(__name__)
MAX_LINE = 1 << 20  # a request's JSON line (arguments and environment)
REAP_S = 0.02  # how often the zygote looks for children that ended (a SIGCHLD wakes it sooner)
_WAKE: list[int] = []  # in the zygote: the pipe its SIGCHLDs write to (`signal.set_wakeup_fd`)
FORK_WAIT_S = 120.0  # for the zygote's answer (its imports first, when it has just started)


class ZygoteError(RuntimeError):
    """The zygote could not fork a child (the caller starts a fresh interpreter)."""


class ForkedProcess:
    """A child of the zygote, with the parts of `subprocess.Popen` the supervisor uses."""

    stdin = None

    def __init__(self, pid: int, serial: int, args: list[str], owner: Zygote,
                 pidfd: int | None = None) -> None:
        self.pid, self.serial, self.args, self._owner = pid, serial, args, owner
        self.pidfd = pidfd  # (signals and liveness through it: never a reused pid's process)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._owner.exit_code(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            rc = self._owner.wait_exit(self, timeout)
            if rc is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = rc
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                if self.pidfd is not None:
                    signal.pidfd_send_signal(self.pidfd, sig)
                else:
                    os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The parent's side: the zygote process, its channel and what it reported. Children are
    told apart by the serial number of the request that made them, never by pid alone (a pid
    comes back once its child is reaped): the zygote reports a child's end before it can fork
    another child that gets the same pid."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # (not our secret, if we hold one: each child gets its own environment; one BLAS thread
        # at most in the zygote, so that nothing but it runs when it forks)
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layersplit.runtime.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            mine.close()
            raise ZygoteError(f"cannot start the zygote ({e})") from None
        finally:
            theirs.close()
        self.sock = mine
        self.lock = threading.Lock()  # one request at a time
        self.cond = threading.Condition()
        self.serials = itertools.count(1)
        self.live: dict[int, int] = {}  # pid -> serial, of children that run
        self.exits: dict[int, int] = {}  # serial -> exit code, of children that ended
        self.replies: dict[int, dict] = {}  # serial -> the zygote's answer
        self.abandoned: set[int] = set()  # requests nobody waits for any more
        self.pidfds: dict[int, int] = {}  # serial -> pidfd, until its ForkedProcess takes it
        self.asking = 0  # the serial of the request in flight
        self.gone = False
        self.foreign = False  # (in a process forked from ours: its children are not ours)
        self.reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self.reader.start()
        _every.add(self)

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
                    self._note(json.loads(line))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("the zygote's channel failed: %s", e)
        with self.cond:
            self.gone = True
            self.cond.notify_all()

    def _note(self, msg: dict) -> None:
        with self.cond:
            if "exit" in msg:
                serial = self.live.pop(int(msg["exit"]), None)
                if serial is not None:
                    self.exits[serial] = int(msg["rc"])
            else:
                # (0: a request the zygote could not read an id from; requests go one at a time,
                # so it answers the one in flight)
                serial = int(msg["id"]) or self.asking
                if "pid" in msg:
                    self.live[int(msg["pid"])] = serial
                    with contextlib.suppress(OSError, AttributeError):
                        self.pidfds[serial] = os.pidfd_open(int(msg["pid"]))
                if serial in self.abandoned:  # (its caller gave up: nobody would stop it)
                    self.abandoned.discard(serial)
                    fd = self.pidfds.pop(serial, None)
                    with contextlib.suppress(OSError):
                        if fd is not None:
                            signal.pidfd_send_signal(fd, signal.SIGKILL)
                            os.close(fd)
                        elif "pid" in msg:
                            os.kill(int(msg["pid"]), signal.SIGKILL)
                else:
                    self.replies[serial] = msg
            self.cond.notify_all()

    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """A child running `layersplit ARGV` with the environment `env`, in our working
        directory (ZygoteError when the zygote is gone or says why it could not)."""
        serial = next(self.serials)
        try:
            cwd = os.getcwd()
        except OSError as e:  # (a directory removed under us: a fresh interpreter copes)
            raise ZygoteError(f"no working directory to hand over ({e})") from None
        line = json.dumps({"id": serial, "argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
        if len(line) > MAX_LINE:
            raise ZygoteError(f"a request of {len(line)} bytes (at most {MAX_LINE})")
        with self.lock:
            for out in (sys.stdout, sys.stderr):  # (what we wrote goes first)
                with contextlib.suppress(Exception):
                    out.flush()
            with self.cond:
                self.asking = serial
            try:
                sent = socket.send_fds(self.sock, [line], [1, 2])
                if sent < len(line):
                    self.sock.sendall(line[sent:])
            except OSError as e:
                raise ZygoteError(f"cannot hand the zygote a request ({e})") from None
            with self.cond:
                reply = None
                try:
                    self.cond.wait_for(lambda: serial in self.replies or self.gone, FORK_WAIT_S)
                    reply = self.replies.pop(serial, None)
                finally:  # (a timeout, or an exception while waiting: its child is killed)
                    if reply is None:
                        self.abandoned.add(serial)
                pidfd = self.pidfds.pop(serial, None)
            if reply is None:
                raise ZygoteError("the zygote is gone" if self.gone else
                                  f"no answer from the zygote in {FORK_WAIT_S:.0f} s")
        if "pid" not in reply:
            raise ZygoteError(str(reply.get("error", reply)))
        return ForkedProcess(int(reply["pid"]), serial, ["layersplit", *argv], self, pidfd)

    def exit_code(self, child: ForkedProcess) -> int | None:
        if self.foreign:  # (as a Popen copied into a forked process says: not its child)
            return 0
        with self.cond:
            rc = self.exits.pop(child.serial, None)
            if rc is None and not self.gone:
                return None
        if rc is None:  # the zygote is gone: the child was handed to init, which reaps it;
            # its exit code is lost (it stops once it sees its parent change: `watch_parent`)
            if _running(child):
                return None
            rc = -signal.SIGKILL
        if child.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(child.pidfd)
            child.pidfd = None
        return rc

    def wait_exit(self, child: ForkedProcess, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while child.returncode is None and child.serial not in self.exits and \
                    not self.gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left)
        while True:
            rc = child.poll()
            if rc is not None or (deadline is not None and time.monotonic() >= deadline):
                return rc
            time.sleep(0.01)

    def close(self) -> None:
        """The zygote exits (at the channel's end); children already forked run on until their
        parent changes (`watch_parent`), which is then."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.reader is not threading.current_thread():  # (its recv sees the channel's end;
            self.reader.join(2)  # the socket closed under it would be a failure: EBADF)
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _running(child: ForkedProcess) -> bool:
    """Whether a child whose zygote is gone still runs (through its pidfd, which a reused pid
    never fools; by pid where there is none)."""
    if child.pidfd is not None:
        return not select.select([child.pidfd], [], [], 0)[0]  # (readable once it exited)
    try:
        return psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_lock = threading.Lock()
_zygote: Zygote | None = None
_every: weakref.WeakSet[Zygote] = weakref.WeakSet()  # (this process's, past ones too)


def zygote() -> Zygote:
    """This process's zygote, started on first use (and again if it died); it ends with this
    process."""
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is not None:
                log.warning("the zygote (pid %d) is gone: starting another", _zygote.proc.pid)
                _zygote.close()
                atexit.unregister(_zygote.close)
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


def _forget_in_child() -> None:
    """In a child forked from this process (not by us: an application's own fork): the zygote
    and its channel are the parent's, never the child's."""
    global _zygote, _lock
    for z in list(_every):  # their children are the parent's: never signalled or waited for
        z.foreign = True
        atexit.unregister(z.close)
        with contextlib.suppress(OSError):
            z.sock.close()
    _zygote, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


# ---- the zygote process ------------------------------------------------------------------------
def _serve(sock: socket.socket, parent: int) -> None:
    """Fork a child per request until the channel ends or our parent is gone; report each
    child's end (at once: a SIGCHLD wakes the loop through `_WAKE`'s pipe)."""
    buf, fds = b"", []
    _WAKE.extend(os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler: the wakeup fd is written)
    signal.set_wakeup_fd(_WAKE[1])
    while os.getppid() == parent:  # (a parent that forked keeps the channel open in its child)
        ready, _, _ = select.select([sock, _WAKE[0]], [], [], REAP_S)
        with contextlib.suppress(BlockingIOError):
            os.read(_WAKE[0], 4096)
        _reap(sock)
        if sock not in ready:
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
            serial = None
            try:
                req = json.loads(line)
                serial = req.get("id") if isinstance(req, dict) else None
                argv, env, cwd = req["argv"], req["env"], req["cwd"]
                if len(mine) != 2 or not isinstance(serial, int) or not isinstance(cwd, str) \
                        or not (isinstance(argv, list) and argv[:1] in (["shard"], ["draft"])
                                and all(isinstance(a, str) for a in argv)) or \
                        not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(
                            v, str) for k, v in env.items())):
                    raise ValueError("expected a shard or draft command's arguments, its "
                                     "environment, a directory and two file descriptors")
                pid = os.fork()
                if pid == 0:
                    _child(sock, argv, env, cwd, mine)
                reply = {"id": serial, "pid": pid}
            except (ValueError, KeyError, TypeError, OSError) as e:
                reply = {"id": serial if isinstance(serial, int) else 0,
                         "error": f"{type(e).__name__}: {e}"}
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
        sock.sendall(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
                     .encode() + b"\n")


def _child(sock: socket.socket, argv: list[str], env: dict[str, str], cwd: str,
           fds: list[int]) -> None:
    """In the forked child: the parent's stdio and the command's environment, then the
    command, which never returns (`launch.processes`: shard and draft processes end in
    os._exit)."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in _WAKE:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _name(f"layersplit-{argv[0]}")
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["layersplit", *argv]
        from layersplit.launch.processes import main

        code = main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
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
    parent = os.getppid()
    sock = socket.socket(fileno=int(sys.argv[1]))
    # a Ctrl-C or a SIGTERM to the whole group is the parent's to handle: it stops its
    # shards; the zygote ends when the parent does (its channel's end, or its pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # what every child needs, imported once here (no device context; one OS thread but
    # OpenBLAS's pool, kept to none by OPENBLAS_NUM_THREADS=1: safe to fork); the commands'
    # own imports inside functions too (a child that imported them itself took ~50 ms more
    # to start, 2 CPU shards ~0.1 s of a 2-core machine)
    import layersplit.draft.server
    import layersplit.launch.processes
    import layersplit.runtime.config
    import layersplit.runtime.handover
    import layersplit.runtime.model_store
    import layersplit.runtime.tokenizer  # (a classic draft compares its vocabulary)
    import layersplit.shards.checkpoint_gguf
    import layersplit.shards.checkpoint_hf
    import layersplit.shards.worker  # noqa: F401
    import torch
    import torch.utils._device  # noqa: F401 - (what building a layer on a device imports)

    if torch.cuda.is_initialized():  # (a child could not use a device a parent had opened)
        print("layersplit zygote: the imports opened a CUDA context; not forking",
              file=sys.stderr)
        return  # (the channel ends: each process starts fresh, `supervisor._start`)
    warnings.filterwarnings("ignore", ".*fork.*", DeprecationWarning)  # (3.12's thread count)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _serve(sock, parent)
    # the channel ended: nothing here to flush or close (the children run on, on their own), and
    # an interpreter that imported torch takes ~0.5 s of a core to tear down, which the parent
    # waits for at its exit (`Zygote.close`): end now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
