"""Messages to the shards and the draft, and the one loop that waits for their replies.

Every reply reaches the coordinator through `Replies._wait`, which also keeps the results of
steps in flight (`runtime.step_driver`), notices dead processes and lost connections, and ends
the run on a shard's failure. `Replies` is one part of `runtime.coordinator.Coordinator`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from layersplit.ipc.curve import needs_curve
from layersplit.ipc.messages import ProtocolError, message
from layersplit.ipc.shm import SLEEP_POLL_MS
from layersplit.ipc.sockets import recv, send
from layersplit.ipc.transport import RingInbox, zmq_array
from layersplit.runtime.errors import DraftError, DraftLost
from layersplit.runtime.shard_group import _name, _Shard
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("layersplit.runtime.coordinator")  # (one name for the coordinator's parts)
POLL_MS = 50


class Replies:
    """Requests to one shard (`_call`), to all of them and the draft (`call_all`), and the
    wait for what comes back (`_wait`, `_drain`)."""

    def _new_sid(self) -> int:
        self._sid += 1
        return self._sid

    def _call(self, sh: _Shard, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        sid = self._new_sid()
        send(sh.sock, {**msg, "sid": sid})
        reply, _ = self._wait(lambda s, m: s is sh, deadline, f"{msg['type']} to {_name(sh)}",
                              sid, on_draft=sh.index < 0)
        return reply

    def call_all(self, make, draft: Any = None, deadline: float | None = None,
                 what: str = "a prefix-cache operation") -> list[dict[str, Any]]:
        """Send `make(shard)` (a message, or a message and its payload frames) to every shard,
        and `draft` (the same) to the draft process when given and it serves; return the `ok`
        replies, shards in order, then the draft's, by `deadline` (default: step_timeout from
        now). A draft lost meanwhile just does not reply (speculation is off from then on)."""
        self._ensure_up()
        self._drain()
        sid = self._new_sid()
        for sh in self.shards:
            made = make(sh)  # a message, or (message, payload frames)
            msg, frames = made if isinstance(made, tuple) else (made, ())
            send(sh.sock, {**msg, "sid": sid}, frames)
        pending = {sh.index for sh in self.shards}
        if draft is not None and self.draft is not None:
            msg, frames = draft if isinstance(draft, tuple) else (draft, ())
            send(self.draft.sock, {**msg, "sid": sid}, frames)
            pending.add(-1)
        replies: dict[int, dict[str, Any]] = {}
        if deadline is None:
            deadline = time.monotonic() + self.config.step_timeout
        draft_deadline = None
        while pending:
            if pending == {-1} and draft_deadline is None:  # the shards are done: the draft's
                # part is as quick; a silent draft (no heartbeats on one host) only loses
                # speculation, after step_deadline_min
                draft_deadline = min(deadline, time.monotonic() + self.config.step_deadline_min)
            try:  # a draft that fails or times out here only stops speculation
                msg, _ = self._wait(lambda s, m: m["type"] == "ok" and m.get("sid") == sid,
                                    draft_deadline or deadline, what, sid,
                                    on_draft=-1 in pending, blame_draft=lambda: pending == {-1})
            except (DraftError, DraftLost) as e:  # the draft's part failed: not the shards'
                log.warning("%s: %s", what, e)
                pending.discard(-1)
                continue
            pending.discard(msg["_shard"])
            replies[msg["_shard"]] = msg
        return [replies[i] for i in sorted(replies, key=lambda i: (i < 0, i))]

    def kv_swap(self, direction: str, pairs: Sequence[Sequence[int]]) -> None:
        """Copy blocks between every shard's device KV pool and its host pool (`direction`
        "out": device -> host, "in": host -> device), for each [device block, host block];
        returns once every shard has its copies queued (done, on a CPU; on a GPU the steps sent
        after this run after them: `shards.host_kv`) (swap preemption, `runtime.batching`)."""
        msg = message("kv_swap", direction=direction, pairs=[list(p) for p in pairs])
        self.call_all(lambda sh: msg)

    def _drain(self, wait_ms: int = 0) -> None:
        """Handle messages nobody waits for: finished saves; stale replies (e.g. to a rejected
        stray frame) are discarded before a new operation."""
        # (one poll of the registered sockets, then only those with a message drained: this
        # runs before every step, and a socket's own poll builds a poller each call)
        ready = {sock for sock, _ in self._poller.poll(wait_ms)}
        for sh in self.shards + ([self.draft] if self.draft is not None else []):
            if sh.sock not in ready:
                continue
            while not sh.sock.closed and sh.sock.poll(0):  # (a draft lost meanwhile: closed)
                _, msg, frames, err = recv(sh.sock)
                if err is None and msg["type"] == "saved" and self.cache is not None:
                    self.cache.saves.on_saved(sh.index, msg, frames)
                    continue
                if err is None and msg["type"] == "wake":
                    continue
                if err is None and self._stash(sh, msg, frames):
                    continue
                if err is None and msg["type"] == "error" and msg["code"] == "feed_lost":
                    self._lose_draft(msg["message"])
                    continue
                log.warning("%s: discarding stale %s", _name(sh),
                            err if err is not None else msg.get("message", msg["type"]))

    def _wait(self, match, deadline: float, what: str, sid: int | None = None,
              on_draft: bool = False, blame_draft=lambda: True,
              until=None, step: int | None = None) -> tuple[dict[str, Any], Any] | None:
        """Poll every shard socket (and the draft's) until `match(shard, msg)`; raise on any
        failure.

        An error reply fails the operation if it names this op's `sid` or no sid at all; an
        error of another (earlier) op is logged and skipped. A dead or unreachable shard fails
        the whole runtime. A dead draft only stops speculation: DraftLost is raised when this
        op waits on the draft (`on_draft`), else the wait goes on; so does the deadline, when
        only the draft's answer is missing (`blame_draft()`). Results and errors of steps in
        flight are kept for `step_outputs` on the way; with `until`, the wait ends (None) as soon
        as `until()` holds. `step`: the step in flight whose deadline this is (for the message
        when it is missed)."""
        poller = self._poller
        ring = self._results
        last = self.shards[-1] if self.shards else None
        spin_until = time.monotonic() + self.spin_ms / 1000.0
        seen_draft: Any = False  # the draft the maps below were built with
        while True:
            if self.draft is not seen_draft:  # built again only when the draft is lost
                seen_draft = self.draft
                members = self.shards + ([self.draft] if self.draft is not None else [])
                by_sock = {sh.sock: sh for sh in members}
                by_mon = {sh.monitor: sh for sh in members}
            if until is not None and until():
                return None
            if ring is not None and ring.ready():
                got = self._ring_message(ring)
                if got is not None and not self._stash(last, *got) and match(last, got[0]):
                    return got
                continue
            now = time.monotonic()
            if now >= self._alive_check:  # (every POLL_MS across waits, not at each one's
                # start: a step's wait is one of thousands a second)
                self._alive_check = now + POLL_MS / 1000.0
                self._check_alive(on_draft)
            left = deadline - now
            if left <= 0:
                if on_draft and blame_draft():
                    self._lose_draft(f"no answer to {what} within the time limit")
                    raise DraftLost(f"no answer to {what} within the time limit")
                raise self.fail(self._late(what, step))
            if now < spin_until:
                timeout = 0
            else:
                timeout = min(SLEEP_POLL_MS if ring is not None else POLL_MS,
                              max(1, int(left * 1000)))
                if ring is not None:  # announce sleep, then look once more
                    ring.sleep(True)
                    if ring.ready():
                        ring.sleep(False)
                        continue
            events = poller.poll(timeout)
            if ring is not None and timeout:
                ring.sleep(False)
            for sock, _ in events:
                if sock in by_mon:
                    recv_monitor_message(sock)
                    sh = by_mon[sock]
                    why = (f"lost the connection to {_name(sh)} at {sh.address} (it closed, "
                           f"or left heartbeats unanswered for {self.config.heartbeat_timeout} "
                           "s: heartbeat_timeout)" if sh.proc is None else
                           f"lost the connection to {_name(sh)} (it closed its socket)")
                    if not sh.welcomed and needs_curve(sh.address):
                        # CurveZMQ drops a handshake sealed to another key without a word
                        why = (f"{_name(sh)} at {sh.address}: authentication failed: the "
                               "encrypted channel did not open (a wrong shared secret, or no "
                               "layersplit shard there); give both ends the same --secret-file")
                    if sh.proc is not None:  # a local process: say how it died, if it did
                        try:
                            sh.proc.proc.wait(0.5)
                        except Exception:  # noqa: BLE001 - still running: it hangs, or exits
                            pass
                        self._check_alive(on_draft)
                        said = sh.proc.error_text()  # (written before it exits)
                        if said:
                            why = f"{sh.proc.name} failed: {said}"
                    if sh.index < 0:
                        self._draft_failed(why, on_draft)
                        break  # the poller changed
                    raise self.fail(why)
                sh = by_sock.get(sock)
                if sh is None:  # a draft dropped earlier in this batch of events
                    continue
                _, msg, frames, err = recv(sock)
                if err is not None:
                    why = f"{_name(sh)} sent a malformed message: {err}"
                    if sh.index < 0:
                        self._draft_failed(why, on_draft)
                        break
                    raise self.fail(why)
                if msg["type"] == "wake":
                    continue
                if msg["type"] == "saved" and self.cache is not None:
                    self.cache.saves.on_saved(sh.index, msg, frames)
                    continue
                msg["_shard"] = sh.index
                if self._stash(sh, msg, frames):
                    continue
                if msg["type"] == "error":
                    err_sid = msg.get("sid")
                    mine = sid is not None and err_sid == sid
                    if sh.index < 0:
                        if mine:
                            raise DraftError(msg["message"])
                        log.warning("%s", msg["message"])
                        continue
                    if msg["code"] == "feed_lost":  # a shard could not hand the draft its rows
                        self._lose_draft(msg["message"])
                        if on_draft:  # (what this waits for will not come)
                            raise DraftLost(msg["message"])
                        break  # the draft's socket, maybe among these events, is closed
                    if err_sid is not None and err_sid in self._back:
                        # a second report of a step that failed already (shards behind a zmq
                        # edge also pass their errors back upstream)
                        log.debug("%s: %s", _name(sh), msg["message"])
                        continue
                    if mine or msg["code"] == "bad_upstream":
                        raise self.fail(msg["message"], keep_running=True)
                    # an error about some other (earlier, or unreadable) message: not this op's
                    log.warning("shard %d: %s", sh.index, msg["message"])
                    continue
                if match(sh, msg):
                    return msg, zmq_array(msg, frames) if msg["type"] == "result" else frames
                log.debug("ignoring %s from %s while waiting for %s", msg["type"], _name(sh),
                          what)

    def _late(self, what: str, step: int | None) -> str:
        """Why a wait ran out of time: the step's deadline, and the local processes that are
        stopped (SIGSTOP, a debugger), when some are."""
        if step in self._in_flight:
            _, _, kind, _, rows = self._in_flight[step]
            why = (f"{what} ({kind}, {rows} rows) missed its deadline of "
                   f"{self.deadlines.describe(kind, rows)}")
        else:
            why = f"no answer to {what} within the time limit (step_timeout / startup_timeout)"
        stopped = [p.name + f" (pid {p.pid})" for p in self.procs if p.stopped()]
        if stopped:
            return f"{why}: {', '.join(stopped)} is stopped and hung"
        return f"{why}: a shard is hung or far slower than before"

    def _ring_message(self, ring: RingInbox) -> tuple[dict[str, Any], Any] | None:
        try:
            got = ring.poll()
        except ProtocolError as e:
            raise self.fail(f"malformed result from the last shard: {e}") from None
        if got is None:
            return None
        msg, t, seq = got
        t = None if t is None else t.copy()  # the slot is released now
        ring.release(seq)
        return msg, t
