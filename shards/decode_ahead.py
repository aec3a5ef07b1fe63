"""Decode lookahead: the next decode step is queued behind the current one, its input token
taken on the device from the token the current step samples.

At batch 1 the device would otherwise idle, each token, for the result's trip to the
coordinator and the next step's trip back (~0.2 ms a token on a GPU: a sixth of a small model's
step). The coordinator (`runtime.batching`) sends a step for position p + 1 while the step at p
is still running, marked `prev` = the sid of that step. The last shard posts each step's sampled
tokens on a token board (`ipc.token_board`: its own memory when it is also the first shard,
else memory it shares with the first shard), and the first shard writes the token into the new
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


def deferrable(seqs: Sequence[dict[str, Any]]) -> bool:
    """Whether a step's result may wait for its tokens on the device: every segment samples one
    token plainly (no draft, logprobs or logits processors). A segment may feed the draft: its
    rows went before the sampling, and a plain segment has no verdict."""
    return all(
        seg["sample"] is not None and seg["draft"] is None and seg["plp"] is None
        and seg["sample"].get("lp") is None and not has_processors(seg["sample"])
        and not seg["sample"].get("late_mask") and seg["then"] is None for seg in seqs)
