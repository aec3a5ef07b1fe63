"""Per-step timestamps of every process of a run, to find where a step's time goes between
processes (`bench/step_timeline.py` merges them). Off unless `LAYERSPLIT_STEP_TRACE` names a
folder; then each process appends one JSON line per event to `<folder>/<role>-<pid>.jsonl`:
`[time.monotonic(), event, sid, {details}]`. `time.monotonic` is the host's one clock
(CLOCK_MONOTONIC), the same in every process of it, so events of one step line up across
processes of one host.

The folder is made private to the user (0700) and each file is 0600. Lines are buffered and
written every `FLUSH_EVERY` events and when the process exits normally; a process that is
killed loses its last ones.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "LAYERSPLIT_STEP_TRACE"
FLUSH_EVERY = 512


class StepTrace:
    """A process's trace file; call it with (event, sid, **details)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.file = os.fdopen(fd, "a", encoding="utf-8")
        self.lines: list[str] = []
        atexit.register(self.close)

    def __call__(self, event: str, sid: int | None, **details: Any) -> None:
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


def step_trace(role: str) -> StepTrace | None:
    """This process's trace (`role`: "coordinator", "shard0", "draft", ...), or None when
    `LAYERSPLIT_STEP_TRACE` is unset or empty."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    path = Path(folder)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return StepTrace(path / f"{role}-{os.getpid()}.jsonl")
