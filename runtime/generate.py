"""The generation loop shared by the single-process reference engine and the split runtime.

An `Engine` runs one forward step of one sequence; this module decides the steps: prefill chunks
(see `shards.chunking`), then one decode step per token, and when to stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from layersplit.runtime.textstream import TextStream
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.sampling_params import SamplingParams
from layersplit.shards.spec_tree import depths, rows_to_move


@dataclasses.dataclass(slots=True)
class StepOutput:
    token: int | None  # sampled token for the position after the step's last row (after the
    # last accepted row, for a verify step)
    logits: np.ndarray | None = None  # float32 (vocab,) of the last row, when asked
    accepted: int = 0  # draft tokens a verify step kept
    path: list[int] | None = None  # their rows, for a tree verify step (`shards.spec_tree`)
    asked: dict | None = None  # a step that asked for the draft's proposal: what came of it
    # (the last shard's outcome `asked`: draft, tree, missed, waited, compute)
    lp: list | None = None  # logprobs of the tokens it emitted (`shards.sampling.logprob_entries`)
    plp: list | None = None  # logprobs of a prompt chunk's next tokens (StepRequest.plp)
    error: str | None = None  # why this sequence's part of the step failed (its logits went
    # non-finite, `shards.finite`): it gets no token, the step's other sequences do
    kept_logits: np.ndarray | None = None  # float32 (accepted, vocab), when asked: the rows
    # a verify step's kept draft tokens were drawn from, in order (`logits`: the last token's)


class Engine(Protocol):
    """One sequence's forward steps. `sample` is None for a prefill chunk that is not the last.
    With `draft`, the step verifies draft tokens: tokens = [last token, *draft], a chain, or
    the token tree `tree` (the draft rows' parents). `kept`: the rows the sequence's last verify
    step kept of its tree, moved to their positions before this step (`shards.spec_tree`)."""

    def forward(
        self, tokens: Sequence[int], pos: int, sample: SamplingParams | None, seed: int,
        want_logits: bool = False, draft: Sequence[int] | None = None,
        tree: Sequence[int] | None = None, kept: Sequence[int] | None = None,
    ) -> StepOutput: ...

    def sample_logits(
        self, logits: np.ndarray, position: int, sample: SamplingParams, seed: int
    ) -> int: ...


@dataclasses.dataclass(slots=True)
class Delta:
    """One step of a streamed generation."""

    token: int
    text: str
    lp: list | None = None  # the token's logprobs entry, when the request asked for them


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
    spec_rounds: int | None = None  # verify steps (None without a draft)
    spec_off_steps: int | None = None  # decode steps the speculation policy ran plainly
    spec_sizes: dict[str, int] | None = None  # draft tokens a verify step proposed (tree
    # nodes, or chain depth) -> verify steps that proposed that many

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
    cache_resident: bool = False  # a RAM hit served from blocks still in the device pool
    spec: Any = None  # runtime.speculative.SpecStats, when a draft served the request
    token_times: list[float] = dataclasses.field(default_factory=list)  # when each came out
    logits: list[np.ndarray] | None = None  # set to [] to record, for each token the sequence
    # drew (a stop token included), the float32 logits it was drawn from: tests compare them
    # position by position (`sequence_program`'s on_logits; a speculated token's are its verify
    # row's)
    logprobs: list = dataclasses.field(default_factory=list)  # an entry per token sampled
    # (stop tokens included), when asked for (`shards.sampling.logprob_entries`)
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # of prompt tokens 1..
    marks: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> when it ended
    # (perf_counter): `admitted` (its program started in a KV slot), `restored` (its cached
    # prefix restored); the server logs them with its own at the first token

    def note_output(self, out: StepOutput) -> None:
        """Keep a sampled step's logprobs (`sequence_program`'s `on_output`)."""
        if out.plp:
            self.prompt_logprobs.extend(out.plp)
        if out.lp:
            self.logprobs.extend(out.lp)

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

    block: int  # the last token and up to block - 1 draft tokens in a row (a tree's depth)
    rows: int  # rows of a verify step: the last token and up to rows - 1 draft tokens

    def propose(self, seq: Sequence[int], pos: int, n: int,
                rows: int) -> tuple[list[int], list[int] | None, list | None]:
        """Up to `rows` draft tokens for positions pos+1 .. pos+n, after seq[pos] (committed
        tokens are seq[:pos + 1]), their tree (parents; None: a chain) and, for a sampled
        proposal, the distributions they were drawn from (`q`, `shards.spec_sampling`; None:
        fixed guesses); ([], None, None) when there are none (a plain decode step then)."""

    def ask(self, pos: int, n: int, rows: int) -> dict | None:
        """Where the draft hands the proposal for `pos` to the first shard itself (prepared
        from the last verdict): the step's `ask` ({n, tree}); None: ask with `propose`."""

    def delivered(self, asked: dict | None) -> tuple[list[int], list[int] | None]:
        """The draft tokens and tree an asking step got (`StepOutput.asked`); ([], None) when
        none came (the step was then a plain decode step)."""

    def then(self) -> dict | None:
        """The proposal it will ask for after a verify step, when room allows a full one: told
        to the draft with the verdict so it is ready sooner (None: nothing to prepare)."""

    def verified(self, pos: int, proposed: int, accepted: int, path: list[int] | None) -> None:
        """The verify step at `pos` kept `accepted` of `proposed` draft positions (`path`: the
        rows kept, for a tree)."""


@dataclasses.dataclass(slots=True)
class StepRequest:
    """A forward step a sequence program asks for (`Engine.forward`'s arguments). `wait`:
    the program needs the step's output before it can go on; a prefill chunk whose output
    nobody reads does not, so the next chunk may follow it into the pipeline at once."""

    tokens: list[int]
    pos: int
    sample: SamplingParams | None
    seed: int
    want_logits: bool = False
    draft: list[int] | None = None
    wait: bool = True
    tree: list[int] | None = None
    kept: list[int] | None = None
    then: dict | None = None
    ask: dict | None = None  # {n, tree}: its draft tokens come from the draft (`shards.asked`)
    extra: dict | None = None  # optional sample fields: logprobs, processors (`shards.sampling`)
    plp: dict | None = None  # {targets, k, temperature}: the prompt chunk's logprobs
    error: BaseException | None = None  # its late grammar mask failed (the sequence fails)
    q: list | None = None  # a sampled proposal's distributions (`shards.spec_sampling`)
    prev: int | None = None  # a lookahead step (`runtime.batching`): its token is the one step
    # `prev` samples for the sequence, taken on the device (`tokens` holds a placeholder)
    on_out: Callable[[StepOutput, int | None], None] | None = None  # a step nobody waits for
    # whose output is still read: called with it and its step id (None in one process) as it
    # comes back (the program has gone on meanwhile)

    @property
    def rows(self) -> int:
        """The rows it may have: an asking step grows by its draft tokens on the way."""
        return len(self.tokens) + (max(self.ask["n"], self.ask["tree"]) if self.ask else 0)


@dataclasses.dataclass(slots=True)
class SampleRequest:
    """A token to draw from stored logits (an exact prefix-cache hit)."""

    logits: np.ndarray
    position: int
    sample: SamplingParams
    seed: int
    extra: dict | None = None  # as StepRequest.extra; with it, the program is sent a StepOutput


# A sequence program yields StepRequest (and is sent a StepOutput, or None when `wait` is
# false), SampleRequest (sent the token) and int (a generated token; sent None).
Program = Generator["StepRequest | SampleRequest | int", "StepOutput | int | None", None]


def sequence_program(
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
    boundaries_wait: bool = True,
    context: int | None = None,
    drafter: Drafter | None = None,
    on_logits: Callable[[np.ndarray], None] | None = None,
    step_fields: Callable[[Sequence[int]], dict | None] | None = None,
    on_output: Callable[[StepOutput], None] | None = None,
    prompt_lp: dict | None = None,
) -> Program:
    """One sequence's generation as the steps it needs, for a driver to run (alone:
    `token_stream`; batched with others: `runtime.batching`). Yields generated tokens forever
    (the caller stops). KV rows [0, start) must already hold the prefix; with start ==
    len(prompt), `start_logits` are the logits of the last prompt row. `on_prefill_boundary(end,
    logits)` runs after each prefill chunk whose output was waited for; logits are returned for
    chunk ends listed in `logits_at`. A chunk that ends at one of them before the prompt's end
    is waited for only with `boundaries_wait`; without, the next chunks follow it into the
    pipeline at once and `on_prefill_boundary` runs as its output comes back (`StepRequest.
    on_out`), before the prompt's last chunk is back. It ends when the context (`context`
    tokens) is full.

    With a `drafter`, each step after the first token verifies the draft tokens it proposes:
    the step's rows are [last token, *draft], and it yields the draft tokens the target kept,
    then continues from the token the target drew after them (`shards.accept.accept_draft`).
    Every yielded token is the one plain decoding yields.

    `step_fields(generated)` gives the optional sample fields (`shards.sampling`: logprobs,
    logits processors) of the step that samples the token after `generated` (the tokens so
    far); `on_output` is called with each sampled step's output (its logprobs). With
    `prompt_lp` ({k, temperature}) every prefill chunk returns its rows' logprobs of the next
    prompt token (`StepOutput.plp`; `start` must be 0).

    `on_logits(logits)` (tests, debugging) is called with the logits each token is drawn from
    (before any logits processor), before the token is yielded; steps then return their logits
    (by default they do not): a verify step the rows of every token it emitted."""
    n = len(prompt)
    if n == 0:
        raise ValueError("the prompt is empty")
    record = on_logits is not None

    def fields(gen: Sequence[int]) -> dict | None:
        return None if step_fields is None else step_fields(gen)

    if start == n:
        if start_logits is None:
            raise ValueError("an exact prefix hit needs the stored logits of the last prompt row")
        if record:
            on_logits(np.array(start_logits, dtype=np.float32))
        got = yield SampleRequest(start_logits, n, params, seed, fields([]))
        if isinstance(got, StepOutput):
            if on_output is not None:
                on_output(got)
            got = got.token
        token = got
    else:
        out = None
        for a, b in prefill_chunks(prompt, start, n, chunk, turn_end_ids):
            last, at = b == n, b in logits_at
            needed = last or (at and boundaries_wait) or prompt_lp is not None
            plp = None if prompt_lp is None else {**prompt_lp, "targets": list(prompt[a + 1:b + 1])}
            later = None  # (its logits come back while the next chunks run)
            if at and not needed and on_prefill_boundary is not None:
                later = _boundary_later(on_prefill_boundary, b)
            out = yield StepRequest(list(prompt[a:b]), a, params if last else None, seed,
                                    want_logits=at or (last and record),
                                    wait=needed, extra=fields([]) if last else None, plp=plp,
                                    on_out=later)
            if on_output is not None and needed and (last or plp is not None):
                on_output(out)
            if on_prefill_boundary is not None and needed and (last or at):
                on_prefill_boundary(b, out.logits)
        assert out is not None and out.token is not None
        if record:
            on_logits(out.logits)
        token = out.token
    pos = n
    seq = list(prompt)
    kept = None  # the tree rows the last verify step kept, still to be moved into place
    while context is None or pos < context:  # prompt + generated never exceed the context
        yield token  # at position pos
        seq.append(token)
        extra = fields(seq[n:])
        drafts, tree, ask, q = [], None, None, None
        if drafter is not None:
            room = drafter.block if context is None else min(drafter.block, context - pos)
            rows = drafter.rows if context is None else min(drafter.rows, context - pos)
            if room > 1:
                ask = drafter.ask(pos, room - 1, rows - 1)
                if ask is None:
                    drafts, tree, q = drafter.propose(seq, pos, room - 1, rows - 1)
        if ask is not None or drafts:
            step = StepRequest([token, *drafts], pos, params, seed, want_logits=record,
                               draft=drafts or None, tree=tree, kept=kept, ask=ask, extra=extra,
                               q=q)
            # a full proposal fits after this step, whatever it keeps: the draft may prepare it
            if context is None or context - pos - step.rows >= max(drafter.rows, drafter.block):
                step.then = drafter.then()
            out = yield step
            if on_output is not None:
                on_output(out)
        if ask is not None:  # the draft handed the first shard this step's draft tokens
            drafts, tree = drafter.delivered(out.asked)
            if not drafts:  # it ran as a plain decode step
                kept = None
                if record:
                    on_logits(out.logits)
                assert out.token is not None
                token, pos = out.token, pos + 1
                continue
        if drafts:
            path = out.path if tree is not None else list(range(1, out.accepted + 1))
            if path is None or len(path) != out.accepted or any(
                    not 1 <= j <= len(drafts) for j in path) or path != sorted(set(path)):
                raise ValueError(f"a verify step returned the path {path} for "
                                 f"{out.accepted} kept tokens of {len(drafts)}")
            drafter.verified(pos, max(depths(tree)) if tree else len(drafts), out.accepted,
                             path if tree is not None else None)
            kept = rows_to_move(path)
            for i, j in enumerate(path):
                if record:
                    on_logits(out.kept_logits[i])
                yield drafts[j - 1]
                seq.append(drafts[j - 1])
            if record:
                on_logits(out.logits)
        else:
            out = yield StepRequest([token], pos, params, seed, want_logits=record, kept=kept,
                                    extra=extra)
            if on_output is not None:
                on_output(out)
            kept = None
            if record:
                on_logits(out.logits)
        assert out.token is not None
        token, pos = out.token, pos + 1 + out.accepted


def _boundary_later(on_boundary: Callable[..., None], end: int
                    ) -> Callable[[StepOutput, int | None], None]:
    def on_out(out: StepOutput, sid: int | None) -> None:
        on_boundary(end, out.logits, sid)
    return on_out


def drive(engine: Engine, program: Program) -> Iterator[int]:
    """Run a sequence program step by step on `engine`, yielding its tokens."""
    try:
        item = next(program)
        while True:
            if isinstance(item, StepRequest):
                out = engine.forward(item.tokens, item.pos, item.sample, item.seed,
                                     item.want_logits, item.draft, item.tree, item.kept)
                if item.on_out is not None and not item.wait:
                    item.on_out(out, None)
                item = program.send(out)
            elif isinstance(item, SampleRequest):
                item = program.send(engine.sample_logits(item.logits, item.position, item.sample,
                                                         item.seed))
            else:
                yield item
                item = next(program)
    except StopIteration:
        return
    finally:
        program.close()


def token_stream(engine: Engine, prompt: Sequence[int], params: SamplingParams, seed: int,
                 **kw: Any) -> Iterator[int]:
    """Generated tokens of one sequence run alone on `engine` (`sequence_program`'s options)."""
    return drive(engine, sequence_program(prompt, params, seed, **kw))


class OutputStream:
    """Applies max_tokens, stop tokens and stop strings to one sequence's tokens as they are
    pushed, turning them into text deltas (empty text without a tokenizer: random-weight models
    for benchmarks). `finished` once the sequence must stop; `close` gives the held-back tail."""

    def __init__(self, tokenizer: TextTokenizer | None, params: SamplingParams,
                 eos_ids: Collection[int], progress: Progress) -> None:
        self.params, self.progress = params, progress
        self.stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stops.update(eos_ids)
        self.text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
        self.finished = params.max_tokens == 0
        self.pushed = 0  # tokens pushed (stop tokens included): the index of their logprobs
        if self.finished:
            progress.finish_reason = "length"

    def push(self, tok: int) -> list[Delta]:
        progress = self.progress
        now = time.perf_counter()
        if progress.first_token_at is None:
            progress.first_token_at = now
        progress.token_times.append(now)
        lp = (progress.logprobs[self.pushed] if self.pushed < len(progress.logprobs) else None)
        self.pushed += 1
        if tok in self.stops:
            progress.finish_reason = "stop"
            self.finished = True
            return []
        progress.generated.append(tok)
        delta = self.text.push(tok) if self.text is not None else ""
        progress.text += delta
        if self.text is not None and self.text.stopped:
            progress.finish_reason = "stop"
            self.finished = True
            return [Delta(tok, delta, lp)] if delta or lp else []
        if len(progress.generated) >= self.params.max_tokens:
            progress.finish_reason = "length"
            self.finished = True
        return [Delta(tok, delta, lp)]

    def close(self) -> list[Delta]:
        tail = self.text.finish() if self.text is not None else ""
        self.progress.finished_at = time.perf_counter()
        if tail:
            self.progress.text += tail
            return [Delta(-1, tail)]
        return []


def stream_generation(
    tokens: Iterator[int],
    tokenizer: TextTokenizer | None,
    params: SamplingParams,
    eos_ids: Collection[int],
    progress: Progress,
) -> Iterator[Delta]:
    """`OutputStream` over a token iterator: yields text deltas until the sequence stops."""
    out = OutputStream(tokenizer, params, eos_ids, progress)
    try:
        if not out.finished:
            for tok in tokens:
                yield from out.push(tok)
                if out.finished:
                    break
        yield from out.close()
    finally:
        tokens_close = getattr(tokens, "close", None)
        if tokens_close is not None:
            tokens_close()
        progress.finished_at = time.perf_counter()


def collect(deltas: Iterator[Delta], progress: Progress, prompt_tokens: int) -> GenerationResult:
    for _ in deltas:
        pass
    spec = progress.spec
    return GenerationResult(
        text=progress.text,
        tokens=list(progress.generated),
        prompt_tokens=prompt_tokens,
        finish_reason=progress.finish_reason,
        ttft_s=progress.ttft_s,
        decode_tok_s=progress.decode_tok_s,
        cached_tokens=progress.cached_tokens,
        cache_tier=progress.cache_tier,
        acceptance_length=None if spec is None else spec.acceptance_length,
        spec_rounds=None if spec is None else spec.verifies,
        spec_off_steps=None if spec is None else spec.off_steps,
        spec_sizes=None if spec is None else {str(k): v for k, v in sorted(spec.sizes.items())},
    )
