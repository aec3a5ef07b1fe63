"""A server process's watch on the process that started it: when that parent is gone (kill -9
included), the process exits, so that no shard, draft or helper process outlives its run."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil
from layersplit.ipc.shm import release_cuda_event_files

log = logging.getLogger(__name__)


def watch_parent(parent_pid: int, on_gone: Callable[[], None],
                 role: str = "shard") -> threading.Thread:
    """Exit (code 3) when the process `parent_pid` that started us is gone: `on_gone` runs
    first (names of rings not yet mapped by their peer, for instance), then CUDA's event files
    are released (`ipc.shm`: os._exit skips the driver's). `role` names us in the log."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
                log.warning("%s: the process that started it (%d) is gone; exiting", role,
                            parent_pid)
                on_gone()
                release_cuda_event_files()
                os._exit(3)
            time.sleep(0.2)

    t = threading.Thread(target=run, name="parent-watch", daemon=True)
    t.start()
    return t
