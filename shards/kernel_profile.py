"""What a shard's (or the draft's) device did during some of its steps: a torch.profiler trace
of those steps, kernels with their device times, for `bench/kernel_summary.py`. Off unless
`LAYERSPLIT_KERNEL_PROFILE` names a folder (`DIR`, or `DIR:SKIP:STEPS`: the process profiles
its steps SKIP+1 .. SKIP+STEPS, default 200 and 100, so that captures and warm-up runs are
left out); the folder is private to the user (`ipc.step_trace.private_folder`), each trace
a new 0600 file `<role>-<pid>-<ns>.json` (Chrome trace format). The profiler slows the steps it
records; their kernels' device times are what it is for, not the wall time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from layersplit.ipc.step_trace import private_folder

log = logging.getLogger(__name__)
ENV = "LAYERSPLIT_KERNEL_PROFILE"
SKIP, STEPS = 200, 100


class KernelProfile:
    """Call `step()` after each step of the process; the profile is written after the last
    profiled one (or at `close`)."""

    def __init__(self, folder: Path, role: str, skip: int, steps: int) -> None:
        self.path = folder / f"{role}-{os.getpid()}-{time.time_ns()}.json"
        self.skip, self.steps, self.seen = skip, steps, 0
        self.prof = None

    def step(self) -> None:
        """After a step (never fails it: a profiler that cannot start or stop is turned off,
        said once)."""
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - a diagnostic never stops a step
            log.warning("%s: profiling stopped (%s: %s)", ENV, type(e).__name__, e)
            self.prof, self.steps = None, 0

    def _step(self) -> None:
        self.seen += 1
        if self.seen == self.skip and self.prof is None and self.steps > 0:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        elif self.prof is not None and self.seen >= self.skip + self.steps:
            self.close()

    def close(self) -> None:
        """Stop profiling and write the trace (once; nothing if no step was profiled)."""
        prof, self.prof = self.prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        self.steps = 0  # (one profile per process)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:  # (someone else's file, or none can be made: left alone)
            log.warning("%s: cannot write %s (%s)", ENV, self.path, e)
            return
        os.close(fd)
        try:
            prof.export_chrome_trace(str(self.path))  # (it writes the file anew: in our
            os.chmod(self.path, 0o600)  # private folder, then private itself)
            log.info("kernel profile of %d steps: %s", self.seen - self.skip, self.path)
        except BaseException as e:
            log.warning("%s: cannot write %s (%s)", ENV, self.path, e)
            with contextlib.suppress(OSError):
                self.path.unlink()  # (ours: made above)
            if not isinstance(e, Exception):
                raise


def kernel_profile(role: str) -> KernelProfile | None:
    """The process's profile, or None when `LAYERSPLIT_KERNEL_PROFILE` is unset, malformed
    (logged) or its folder cannot be used (logged)."""
    value = os.environ.get(ENV)
    if not value:
        return None
    folder, *counts = value.rsplit(":", 2) if value.count(":") >= 2 else (value,)
    try:
        skip, steps = (int(counts[0]), int(counts[1])) if counts else (SKIP, STEPS)
        if skip < 1 or steps < 1:
            raise ValueError("SKIP and STEPS must be at least 1")
    except ValueError as e:
        log.warning("%s=%s: expected DIR or DIR:SKIP:STEPS (%s): no kernel profile", ENV, value,
                    e)
        return None
    path = private_folder(folder, ENV)
    return None if path is None else KernelProfile(path, role, skip, steps)
