"""The main loop of a server process (a shard, the draft): spin while busy, then sleep.

After work, the loop spins for `spin_s` (a message that arrives then is taken within
microseconds: no wake-up latency on the decode path); idle longer, it tells its shared-memory
rings it sleeps, looks once more (a post may race the announcement), and blocks on its zmq
sockets until a doorbell or a control message arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from layersplit.ipc.shm import SLEEP_POLL_MS
from layersplit.ipc.transport import RingInbox


def serve(running: Callable[[], bool], work: Callable[[], bool],
          inboxes: Callable[[], list[RingInbox]], block: Callable[[int], object],
          spin_s: Callable[[], float]) -> None:
    """Until `running()` is false: `work()` (True if it did any); when idle past `spin_s()`,
    `block(timeout_ms)` on the sockets, the rings from `inboxes()` marked asleep meanwhile."""
    idle_since = time.monotonic()
    while running():
        if work():
            idle_since = time.monotonic()
            continue
        if time.monotonic() - idle_since < spin_s():
            continue
        rings = inboxes()
        for r in rings:
            r.sleep(True)
        if not any(r.ready() for r in rings):
            block(SLEEP_POLL_MS if rings else 200)
        for r in rings:
            if not r.closed:  # (a reconfigure while blocked may have closed it)
                r.sleep(False)
