"""The main loop of a server process (a shard, the draft): spin while busy, then sleep.

After work, the loop spins for `spin_s` (a message that arrives then is taken within
microseconds: no wake-up latency on the decode path); idle longer, it tells its shared-memory
rings it sleeps, looks once more (a post may race the announcement), and blocks on its zmq
sockets until a doorbell or a control message arrives.

A doorbell can be missed in a rare race (`ipc.shm`), so a sleeper with rings wakes to look at
them: every `SLEEP_POLL_MS` at first, then, idle past `IDLE_BACKOFF_S`, at twice the interval
after each empty look, up to `IDLE_POLL_MS`. A process that nothing talks to for a while (the
draft while the speculation policy decodes plainly: its feature rows parked on the shards) then
wakes ~30 times a second, not 500, and costs the processes that do work no CPU; a doorbell
missed after such a pause costs at most `IDLE_POLL_MS`, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from layersplit.ipc.shm import SLEEP_POLL_MS
from layersplit.ipc.transport import RingInbox

IDLE_BACKOFF_S = 0.25  # idle this long, a sleeper's polls of its rings grow apart ...
IDLE_POLL_MS = 32  # ... up to this


def sleep_ms(idle_s: float, last_ms: int) -> int:
    """How long a sleeper with rings blocks next, idle `idle_s` seconds and having blocked
    `last_ms` the time before (0: it had just worked)."""
    if idle_s < IDLE_BACKOFF_S or last_ms <= 0:
        return SLEEP_POLL_MS
    return min(IDLE_POLL_MS, 2 * last_ms)


def serve(running: Callable[[], bool], work: Callable[[], bool],
          inboxes: Callable[[], list[RingInbox]], block: Callable[[int], object],
          spin_s: Callable[[], float]) -> None:
    """Until `running()` is false: `work()` (True if it did any); when idle past `spin_s()`,
    `block(timeout_ms)` on the sockets (true if it took a message: its polls of the rings
    start again at `SLEEP_POLL_MS`), the rings from `inboxes()` marked asleep meanwhile."""
    idle_since = quiet_since = time.monotonic()  # (quiet: no message taken while blocked either)
    last_ms = 0
    while running():
        if work():
            idle_since = quiet_since = time.monotonic()
            last_ms = 0
            continue
        now = time.monotonic()
        if now - idle_since < spin_s():
            continue
        rings = inboxes()
        for r in rings:
            r.sleep(True)
        if not any(r.ready() for r in rings):
            last_ms = sleep_ms(now - quiet_since, last_ms) if rings else 200
            if block(last_ms):
                quiet_since, last_ms = time.monotonic(), 0
        for r in rings:
            if not r.closed:  # (a reconfigure while blocked may have closed it)
                r.sleep(False)
