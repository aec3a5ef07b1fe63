"""Which machine a process is on, as the transports see it (shared memory needs one host).

A launcher that places processes itself can name the host for them: the Ray launcher sets
`LAYERSPLIT_HOST_ID` to the Ray node id, so `auto` decides from the nodes Ray reports (two Ray
nodes on one machine, as in tests, count as two hosts and talk over zmq/tcp).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOST_ID_ENV = "LAYERSPLIT_HOST_ID"


def host_id() -> str:
    """Identifies this machine (and boot), or the node a launcher named, so two ends can tell
    they share memory."""
    named = os.environ.get(HOST_ID_ENV)
    if named:
        return named
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
