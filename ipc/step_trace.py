"""Per-step timestamps of every process of a run, to find where a step's time goes between
processes (`bench/step_timeline.py` merges them). Off unless `LAYERSPLIT_STEP_TRACE` names a
folder; then each process (each coordinator object) appends one JSON line per event to a file
of its own there, `<role>-<pid>-<n>.jsonl`: `[time.monotonic(), event, sid, {details}]`.
`time.monotonic` is the host's one clock (CLOCK_MONOTONIC), the same in every process of it, so
events of one step line up across processes of one host.

The folder is made private to the user (0700) when this makes it; an existing folder must be
private already (it is never changed). Each file is new and 0600. A folder that cannot be used
turns tracing off with a warning naming the variable: a diagnostic switch never stops a run.
Lines are buffered and written every `FLUSH_EVERY` events, at `close` and when the process
exits normally; a process that is killed loses its last ones.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ENV = "LAYERSPLIT_STEP_TRACE"
FLUSH_EVERY = 512
_files = itertools.count()  # (several traces of one process: several coordinators)


class StepTrace:
    """A trace file; call it with (event, sid, **details)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        self.lines: list[str] = []
        atexit.register(self.close)

    def __call__(self, event: str, sid: int | None, **details: Any) -> None:
        if self.file.closed:
            return
        self.lines.append(json.dumps([time.monotonic(), event, sid, details]))
        if len(self.lines) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.lines and not self.file.closed:
            self.file.write("\n".join(self.lines) + "\n")
            self.file.flush()
        self.lines = []

    def close(self) -> None:
        self.flush()
        self.file.close()
        atexit.unregister(self.close)


def private_folder(folder: str | None, env: str) -> Path | None:
    """`folder` (what the environment variable `env` says), made private to the user (0700)
    if this makes it; an existing one must be private already (it is never changed). None
    when it is unset or empty, or cannot be used (logged, naming `env`): a diagnostic switch
    never stops a run."""
    if not folder:
        return None
    path = Path(folder)
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # (this process made it: the umask may have taken bits)
    except FileExistsError:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or \
                stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("%s=%s is not a folder private to this user (mode %o): nothing is "
                        "written there (chmod 700 it, or name a new folder)", env, folder,
                        stat.S_IMODE(st.st_mode))
            return None
    except OSError as e:
        log.warning("%s=%s: %s: nothing is written there", env, folder, e)
        return None
    return path


def step_trace(role: str) -> StepTrace | None:
    """A new trace (`role`: "coordinator", "shard-0-15", "draft", ...), or None when
    `LAYERSPLIT_STEP_TRACE` is unset or empty, or its folder cannot be used (logged)."""
    path = private_folder(os.environ.get(ENV), ENV)
    if path is None:
        return None
    try:
        return StepTrace(path / f"{role}-{os.getpid()}-{next(_files)}.jsonl")
    except OSError as e:
        log.warning("%s=%s: %s: no step trace", ENV, path, e)
        return None
