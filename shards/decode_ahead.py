"""Decode lookahead on a one-shard runtime: the next decode step is queued behind the current
one, its input token taken on the device from the token the current step samples.

At batch 1 the device would otherwise idle, each token, for the result's trip to the
coordinator and the next step's trip back (~0.2 ms a token on a GPU: a sixth of a small model's
step). The coordinator (`runtime.batching`) sends a step for position p + 1 while the step at p
is still running, marked `prev` = the sid of that step; this shard, being the first and the last,
keeps each slot's last sampled token on the device (`LastTokens`) and writes it into the new
step's input there, so nothing waits for the host. The results of such steps go to the
coordinator once their tokens reach the host (`UnsentResults`), after the next step's kernels
are queued: the device always has the next step in hand.

A lookahead step whose sequence stopped at p (a stop token) is computed and dropped: its one KV
row lies past the sequence's end, in a block the sequence still holds until the step is back.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from layersplit.shards.sampling import has_processors


class LastTokens:
    """Each slot's last token sampled on this shard, on the device, and the step it came from."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        self.sid = [-1] * slots  # the step whose token `tokens[slot]` holds (-1: none yet)
        self.device = device

    def record(self, slots: Sequence[int], tokens: torch.Tensor, sid: int) -> None:
        """`tokens` (len(slots),) int64 on the device, sampled by step `sid`."""
        for i, s in enumerate(slots):
            self.tokens[s:s + 1].copy_(tokens[i:i + 1])
            self.sid[s] = sid

    def forget(self) -> None:
        self.sid = [-1] * len(self.sid)

    def error(self, slot: int, prev: int, n: int) -> str | None:
        """Why a segment of `n` rows may not take its token from step `prev`, or None."""
        if n != 1:
            return f"prev={prev} on a segment of {n} rows (a lookahead step decodes one row)"
        if self.sid[slot] != prev:
            return (f"prev={prev}, but slot {slot}'s last sampled token came from step "
                    f"{self.sid[slot]}")
        return None

    def fill(self, x: torch.Tensor, seqs: Sequence[dict[str, Any]]) -> torch.Tensor:
        """A copy of `x` (a step's token ids, on the device) with each lookahead segment's row
        (`prev` set) its slot's last token: device-to-device copies, no wait for the host."""
        x, row = x.clone(), 0
        for seg in seqs:
            if seg["prev"] is not None:
                x[row:row + 1].copy_(self.tokens[seg["slot"]:seg["slot"] + 1])
            row += seg["n"]
        return x


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of `t`, queued on the device's stream (not waited for)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclasses.dataclass(slots=True)
class _Unsent:
    tokens: torch.Tensor  # (segments,) int64 on the host, copied from the device
    logits: torch.Tensor | None  # (rows, V) float32 on the host, the rows the step returns
    ready: torch.cuda.Event | None  # recorded after the copies (None: on the CPU, done)
    send: Callable[[list[int], torch.Tensor | None], None]  # the result, from them


class UnsentResults:
    """Step results whose sampled tokens are still on their way to the host, in step order."""

    def __init__(self) -> None:
        self.queue: collections.deque[_Unsent] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, tokens: torch.Tensor, logits: torch.Tensor | None,
            send: Callable[[list[int], torch.Tensor | None], None]) -> None:
        """Queue the result `send(token ids, logits)` once `tokens` and `logits` (on the
        device) reach the host."""
        ready = None
        if tokens.is_cuda:
            tokens = _to_host(tokens)
            logits = None if logits is None else _to_host(logits)
            ready = torch.cuda.Event()
            ready.record()
        self.queue.append(_Unsent(tokens, logits, ready, send))

    def flush(self, wait: bool) -> bool:
        """Send the results whose tokens are on the host, oldest first (`wait`: all of them,
        waiting for the device); returns whether any was sent."""
        sent = False
        while self.queue:
            head = self.queue[0]
            if head.ready is not None and not head.ready.query():
                if not wait:
                    break
                head.ready.synchronize()
            self.queue.popleft()
            head.send(head.tokens.tolist(), head.logits)
            sent = True
        return sent

    def clear(self) -> None:
        self.queue.clear()


def deferrable(seqs: Sequence[dict[str, Any]], fed: bool) -> bool:
    """Whether a step's result may wait for its tokens on the device: every segment samples one
    token plainly (no draft, logprobs or logits processors) and none feeds the draft."""
    return not fed and all(
        seg["sample"] is not None and seg["draft"] is None and seg["plp"] is None
        and seg["sample"].get("lp") is None and not has_processors(seg["sample"])
        and not seg["sample"].get("late_mask") and seg["then"] is None for seg in seqs)
