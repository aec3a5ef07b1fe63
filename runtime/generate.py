"""The generation loop shared by the single-process reference engine and the split runtime.

An `Engine` runs one forward step of one sequence; this module decides the steps: prefill chunks
(see `runtime.chunking`), then one decode step per token, and when to stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from runtime.chunking import prefill_chunks
from runtime.textstream import TextStream
from runtime.tokenizer import TextTokenizer
from shards.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class StepOutput:
    token: int | None  # sampled token for the position after the step's last row (after the
    # last accepted row, for a verify step)
    logits: np.ndarray | None = None  # float32 (vocab,) of the last row, when asked
    accepted: int = 0  # draft tokens a verify step kept


class Engine(Protocol):
    """One sequence's forward steps. `sample` is None for a prefill chunk that is not the last.
    With `draft`, the step verifies draft tokens: tokens = [last token, *draft]."""

    def forward(
        self, tokens: Sequence[int], pos: int, sample: SamplingParams | None, seed: int,
        want_logits: bool = False, draft: Sequence[int] | None = None,
    ) -> StepOutput: ...

    def sample_logits(
        self, logits: np.ndarray, position: int, sample: SamplingParams, seed: int
    ) -> int: ...


@dataclasses.dataclass(slots=True)
class Delta:
    """One step of a streamed generation."""

    token: int
    text: str


@dataclasses.dataclass(slots=True)
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    ttft_s: float
    decode_tok_s: float
    cached_tokens: int = 0
    cache_tier: str = "none"
    acceptance_length: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class Progress:
    """Filled in by `stream_generation` as it runs (timings, finish reason)."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str = "length"
    generated: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    cache_tier: str = "none"
    spec: Any = None  # runtime.speculative.SpecStats, when a draft served the request

    @property
    def ttft_s(self) -> float:
        return (self.first_token_at or self.started) - self.started

    @property
    def decode_tok_s(self) -> float:
        n = len(self.generated) - 1
        if n <= 0 or self.first_token_at is None or self.finished_at is None:
            return 0.0
        return n / max(self.finished_at - self.first_token_at, 1e-9)


class Drafter(Protocol):
    """Proposes draft tokens for one sequence (`runtime.speculative.DraftClient`)."""

    block: int  # rows of a verify step: the last token and up to block - 1 draft tokens

    def propose(self, seq: Sequence[int], pos: int, n: int) -> list[int]:
        """Up to n draft tokens for positions pos+1.., after seq[pos] (committed tokens are
        seq[:pos + 1]); [] when there are none (the step is then a plain decode step)."""

    def verified(self, pos: int, proposed: int, accepted: int) -> None:
        """The verify step at `pos` kept `accepted` of `proposed` draft tokens."""


def token_stream(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    seed: int,
    *,
    chunk: int,
    turn_end_ids: Collection[int],
    start: int = 0,
    start_logits: np.ndarray | None = None,
    on_prefill_boundary: Callable[[int, np.ndarray | None], None] | None = None,
    logits_at: Collection[int] = (),
    context: int | None = None,
    drafter: Drafter | None = None,
) -> Iterator[int]:
    """Yield generated tokens forever (the caller stops). KV rows [0, start) must already hold
    the prefix; with start == len(prompt), `start_logits` are the logits of the last prompt row.
    `on_prefill_boundary(end, logits)` runs after each prefill chunk; logits are returned for
    chunk ends listed in `logits_at`. The stream ends when the context (`context` tokens) is full.

    With a `drafter`, each step after the first token verifies the draft tokens it proposes:
    the step's rows are [last token, *draft], and it yields the draft tokens the target kept,
    then continues from the token the target drew after them (`shards.sampling.accept_draft`).
    Every yielded token is the one plain decoding yields."""
    n = len(prompt)
    if n == 0:
        raise ValueError("the prompt is empty")
    if start == n:
        if start_logits is None:
            raise ValueError("an exact prefix hit needs the stored logits of the last prompt row")
        token = engine.sample_logits(start_logits, n, params, seed)
    else:
        out = None
        for a, b in prefill_chunks(prompt, start, n, chunk, turn_end_ids):
            last = b == n
            out = engine.forward(
                prompt[a:b], a, params if last else None, seed, want_logits=b in logits_at
            )
            if on_prefill_boundary is not None:
                on_prefill_boundary(b, out.logits)
        assert out is not None and out.token is not None
        token = out.token
    pos = n
    seq = list(prompt)
    while context is None or pos < context:  # prompt + generated never exceed the context
        yield token  # at position pos
        seq.append(token)
        drafts = []
        if drafter is not None:
            room = drafter.block if context is None else min(drafter.block, context - pos)
            drafts = drafter.propose(seq, pos, room - 1) if room > 1 else []
        if drafts:
            out = engine.forward([token, *drafts], pos, params, seed, draft=drafts)
            drafter.verified(pos, len(drafts), out.accepted)
            for t in drafts[:out.accepted]:
                yield t
                seq.append(t)
        else:
            out = engine.forward([token], pos, params, seed)
        assert out.token is not None
        token, pos = out.token, pos + 1 + out.accepted


def stream_generation(
    tokens: Iterator[int],
    tokenizer: TextTokenizer | None,
    params: SamplingParams,
    eos_ids: Collection[int],
    progress: Progress,
) -> Iterator[Delta]:
    """Apply max_tokens, stop tokens and stop strings to a token stream; yield text deltas
    (empty text without a tokenizer: random-weight models for benchmarks)."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_ids)
    text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
    try:
        if params.max_tokens == 0:
            progress.finish_reason = "length"
            return
        for tok in tokens:
            if progress.first_token_at is None:
                progress.first_token_at = time.perf_counter()
            if tok in stops:
                progress.finish_reason = "stop"
                break
            progress.generated.append(tok)
            delta = text.push(tok) if text is not None else ""
            progress.text += delta
            if text is not None and text.stopped:
                progress.finish_reason = "stop"
                if delta:
                    yield Delta(tok, delta)
                break
            yield Delta(tok, delta)
            if len(progress.generated) >= params.max_tokens:
                progress.finish_reason = "length"
                break
        tail = text.finish() if text is not None else ""
        if tail:
            progress.text += tail
            yield Delta(-1, tail)
    finally:
        tokens_close = getattr(tokens, "close", None)
        if tokens_close is not None:
            tokens_close()
        progress.finished_at = time.perf_counter()


def collect(deltas: Iterator[Delta], progress: Progress, prompt_tokens: int) -> GenerationResult:
    for _ in deltas:
        pass
    return GenerationResult(
        text=progress.text,
        tokens=list(progress.generated),
        prompt_tokens=prompt_tokens,
        finish_reason=progress.finish_reason,
        ttft_s=progress.ttft_s,
        decode_tok_s=progress.decode_tok_s,
        cached_tokens=progress.cached_tokens,
        cache_tier=progress.cache_tier,
        acceptance_length=None if progress.spec is None else progress.spec.acceptance_length,
    )
