"""Each KV slot's last sampled token, for decode lookahead: the shard that samples it (the last)
posts it, the shard that embeds it (the first) takes it, with no message between them and, on
GPUs of one host, no host wait.

A lookahead step (`runtime.batching.Batcher._send_ahead`) is sent before the token it takes is
known; its segment names the step that samples that token (`prev`). On a one-shard runtime the
board is the shard's own memory (`TokenBoard.local`). On a split runtime the last shard creates
it (`TokenBoard.create`) and the first maps it (`TokenBoard.attach`), when the two share a host:

- per slot, the sid of the step whose token the slot holds, in a shared-memory segment
  (`ipc.shm.ShmRing`, one slot, mode 0600, unlinked once mapped);
- *device mode* (both shards on CUDA devices with peer access, and IPC events): the tokens in
  a device buffer the last shard owns and the first maps by CUDA IPC handle. The last shard
  enqueues the copy of a step's tokens into it, records an IPC event behind the copy, then
  writes the sids; the first shard, once it reads the sid it needs, makes its stream wait on
  that event and copies the token into the step's input. The host of neither shard waits for
  the device; the event's most recent record is at or after the one the sid follows.
- *host mode* (anything else on one host, the CPU included): the tokens in the shared segment
  (the last shard waits for them to reach the host), each in one 64-bit word with the sid of
  its step (`pack`): one aligned store, so a reader that sees the sid in the sids before the
  token (a CPU that orders stores weakly, ARM) waits for the word that names that sid
  (`fill`), never takes the slot's earlier token. Likewise a reader that sees the writer
  passed a step before it sees the slot's sid of that step gives the sid a moment (`error`).

A slot's entries are overwritten by the slot's next sampled step only: that step's input comes
through the first shard after it took the entry, so no read can see a later token. Sids only
grow within a configuration, so a sid past the one a step waits for means that step's token
will never come (`error`); a step that failed on its way (`void`, from the coordinator) ends
the wait at once.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from layersplit.ipc.cuda_handoff import ipc_events
from layersplit.ipc.hosts import host_id
from layersplit.ipc.messages import ProtocolError
from layersplit.ipc.shm import ShmRing
from layersplit.ipc.transport import cuda_peer_ok, open_cuda, share_cuda

log = logging.getLogger(__name__)

UNDECIDED, DEVICE, HOST = 0, 1, 2  # the mode word, set by the first shard when it maps the board
_HEAD = 64  # bytes before the sids: the mode word, then the last step the last shard finished
VOIDS_KEPT = 256  # sids of failed steps remembered (a lookahead step follows its step closely)
TOKEN_BITS = 24  # host mode: a word is sid << TOKEN_BITS | token (vocabularies up to 16.7M)
# how long a reader waits for a store it knows was made (a weakly ordered CPU shows it within
# microseconds): the token word of a sid it saw, the sid of a step the writer says it passed
WORD_WAIT_S = 1.0
SID_SHOW_S = 0.05


def pack(sid: int, token: int) -> int:
    """A host-mode word: the token and the sid of the step that sampled it."""
    if not 0 <= token < 1 << TOKEN_BITS or not 0 <= sid < 1 << (63 - TOKEN_BITS):
        raise ValueError(f"token board: token {token} or step {sid} outside the host word")
    return sid << TOKEN_BITS | token


def _layout(slots: int) -> int:
    return _HEAD + 2 * slots * 8  # mode, done | sids | host tokens


class TokenBoard:
    """See the module docstring. `role`: "local" (one process), "writer" or "reader"."""

    def __init__(self, role: str, slots: int, device: torch.device, tokens: torch.Tensor | None,
                 ring: ShmRing | None, event: torch.cuda.Event | None = None) -> None:
        self.role, self.slots, self.device = role, slots, device
        self.tokens = tokens  # (slots,) int64 on a device, or None (host mode only)
        self.ring, self.event = ring, event
        if ring is None:  # one process: plain memory
            self.mode = np.array([DEVICE if tokens is not None else HOST, -1], dtype=np.int64)
            self.sid = np.full(slots, -1, dtype=np.int64)
            self.host = np.zeros(slots, dtype=np.int64)
        else:
            buf = ring.payload(0)
            self.mode = np.frombuffer(buf, dtype=np.int64, count=2)  # [mode, done]
            self.sid = np.frombuffer(buf, dtype=np.int64, count=slots, offset=_HEAD)
            self.host = np.frombuffer(buf, dtype=np.int64, count=slots, offset=_HEAD + 8 * slots)
        self.voids: collections.deque[int] = collections.deque(maxlen=VOIDS_KEPT)

    # ---- making one ------------------------------------------------------------------------
    @classmethod
    def local(cls, slots: int, device: torch.device) -> TokenBoard:
        """The board of a shard that is first and last: tokens stay on its device."""
        tokens = torch.zeros(slots, dtype=torch.int64, device=device) \
            if device.type != "cpu" else None
        return cls("local", slots, device, tokens, None)

    @classmethod
    def create(cls, slots: int, device: torch.device) -> tuple[TokenBoard, dict[str, Any]]:
        """The last shard's half, and what the first shard needs to map it."""
        ring = ShmRing.create(1, _layout(slots))
        try:
            tokens, event, desc = None, None, {"ring": ring.describe(), "host": host_id(),
                                               "device": str(device), "cuda": None,
                                               "event": None}
            if device.type == "cuda":
                made = ipc_events(1, device)
                if made is not None:
                    tokens = torch.zeros(slots, dtype=torch.int64, device=device)
                    event = made[0][0]
                    desc.update(cuda=share_cuda(tokens), event=made[1][0])
            board = cls("writer", slots, device, tokens, ring, event)
            board.sid[:] = -1
            board.mode[1] = -1
            return board, desc
        except BaseException:
            ring.close()
            raise

    @classmethod
    def attach(cls, desc: Any, slots: int, device: torch.device) -> TokenBoard | None:
        """The first shard's half; None where the last shard is on another host (the
        coordinator then sends no step ahead)."""
        if not isinstance(desc, dict) or not isinstance(desc.get("ring"), dict) or \
                not isinstance(desc.get("host"), str) or not isinstance(desc.get("device"), str):
            raise ProtocolError(f"configure: board {str(desc)[:200]} is not a token board's "
                                "description (ring, host, device, cuda, event)")
        if desc["host"] != host_id():
            return None
        try:
            ring = ShmRing.attach(desc["ring"])
        except (ValueError, OSError) as e:
            raise ProtocolError(f"configure: board: {e}") from None
        if ring.payload_bytes != _layout(slots):
            ring.close()
            raise ProtocolError(f"configure: board of {ring.payload_bytes} bytes, expected "
                                f"{_layout(slots)} for {slots} slots")
        tokens, event, mode = None, None, HOST
        if device.type == "cuda" and desc.get("cuda") is not None and \
                isinstance(desc.get("event"), bytes) and desc["device"].startswith("cuda") and \
                cuda_peer_ok(desc["device"], str(device)):
            try:
                tokens = open_cuda(desc["cuda"])  # (its bytes)
                if tokens.numel() < 8 * slots:
                    raise RuntimeError(f"{tokens.numel()} bytes for {slots} slots' tokens")
                tokens = tokens[:8 * slots].view(torch.int64)
                event = torch.cuda.Event.from_ipc_handle(device, desc["event"])
                mode = DEVICE
            except (RuntimeError, KeyError, TypeError) as e:
                log.warning("token board: cannot map the last shard's device buffer (%s): "
                            "lookahead tokens go through host memory", e)
                tokens, event = None, None
        board = cls("reader", slots, device, tokens, ring, event)
        board.mode[0] = mode
        return board

    # ---- the last shard ------------------------------------------------------------------------
    def post(self, slots: Sequence[int], tokens: torch.Tensor, sid: int) -> None:
        """`tokens` (len(slots),) int64 on this shard's device, sampled by step `sid`."""
        if int(self.mode[0]) == HOST or self.tokens is None:
            values = tokens.tolist()  # (waits for the device)
            for s, v in zip(slots, values):
                self.host[s] = pack(sid, v)  # (token and sid in one store)
        else:
            for i, s in enumerate(slots):
                self.tokens[s:s + 1].copy_(tokens[i:i + 1])
            if self.event is not None:
                self.event.record()
        for s in slots:  # (after the tokens: the first shard reads the sid first)
            self.sid[s] = sid
        self.passed(sid)

    def passed(self, sid: int) -> None:
        """This shard is done with step `sid` (posted, or failed): a step that waits for a
        token of it or of an earlier step waits no longer (steps reach it in sid order)."""
        self.mode[1] = max(int(self.mode[1]), sid)

    # ---- the first shard -----------------------------------------------------------------------
    def void(self, sid: int) -> None:
        """Step `sid` failed: a step waiting for its tokens fails now."""
        self.voids.append(sid)

    def waits(self, seqs: Sequence[dict[str, Any]], sid: int) -> bool:
        """Whether the lookahead segments of step `sid` still wait for their tokens to be
        posted (a `prev` not before `sid`, or a slot outside the board, waits for nothing: the
        step's check refuses it by name)."""
        return self.role == "reader" and any(
            seg["prev"] is not None and seg["prev"] < sid and 0 <= seg["slot"] < self.slots
            and int(self.sid[seg["slot"]]) < seg["prev"]
            and int(self.mode[1]) < seg["prev"] and seg["prev"] not in self.voids
            for seg in seqs)

    def error(self, slot: int, prev: int, n: int) -> str | None:
        """Why a segment of `n` rows may not take its token from step `prev`, or None."""
        if n != 1:
            return f"prev={prev} on a segment of {n} rows (a lookahead step decodes one row)"
        got = int(self.sid[slot])
        if got < prev <= int(self.mode[1]) and prev not in self.voids:
            # the writer stores a slot's sid before it says it passed the step: on a weakly
            # ordered CPU the second store may show first, so the sid gets a moment to show
            deadline = time.monotonic() + SID_SHOW_S
            while got < prev and time.monotonic() < deadline:
                time.sleep(0)
                got = int(self.sid[slot])
        if got != prev:
            why = (f"step {prev} failed" if prev in self.voids else
                   "a later step sampled it since" if got > prev else
                   f"step {prev} did not sample it" if int(self.mode[1]) >= prev else
                   "its token did not come")
            return f"prev={prev}, but slot {slot}'s last sampled token came from step {got} " \
                   f"({why})"
        return None

    def fill(self, x: torch.Tensor, seqs: Sequence[dict[str, Any]]) -> torch.Tensor:
        """A copy of `x` (a step's token ids, on this shard's device) with each lookahead
        segment's row (`prev` set) its slot's last token (checked: `error`)."""
        x, row = x.clone(), 0
        device = self.tokens is not None and int(self.mode[0]) == DEVICE
        if device and self.event is not None and self.role == "reader":
            torch.cuda.current_stream(self.device).wait_event(self.event)
        for seg in seqs:
            if seg["prev"] is not None:
                s = seg["slot"]
                if device:
                    x[row:row + 1].copy_(self.tokens[s:s + 1])
                else:
                    x[row] = self._host_token(s, seg["prev"])
            row += seg["n"]
        return x

    def _host_token(self, slot: int, sid: int) -> int:
        """The token step `sid` posted for `slot` in host mode: its word, once it names that
        step (the sid was seen first: the word was stored before it, and shows soon)."""
        word = int(self.host[slot])
        deadline = time.monotonic() + WORD_WAIT_S
        while word >> TOKEN_BITS != sid:
            late = time.monotonic() > deadline
            time.sleep(0)
            word = int(self.host[slot])  # (read once more past the deadline before failing)
            if late and word >> TOKEN_BITS != sid:
                raise ProtocolError(f"token board: slot {slot}'s token of step {sid} did not "
                                    f"show within {WORD_WAIT_S} s (its word names step "
                                    f"{word >> TOKEN_BITS})")
        return word & ((1 << TOKEN_BITS) - 1)

    def close(self) -> None:
        if self.role == "reader" and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # (no copy of ours reads it)
        self.tokens, self.event = None, None
        if self.ring is not None:
            self.mode = self.sid = self.host = None  # (views of the mapping, which goes)
            self.ring.close()
            self.ring = None
