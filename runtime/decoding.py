"""What a request asks of decoding beyond `SamplingParams`: logprobs and logits processors.

The coordinator turns them, step by step, into the optional fields of the step's sample dict
(`shards.sampling`), which the last shard applies before it samples: presence and frequency
penalties (over the tokens generated so far), `logit_bias` and `min_tokens` become one additive
`bias`; the repetition penalty is `rep` over the prompt's and the generated tokens (as vLLM's);
a grammar (`runtime.grammar`) gives the `mask` of the tokens it allows next: computed while the
step runs (`LATE_MASK`: the step is sent first, then the mask, straight to the last shard, which
samples once it has it), since the mask follows the token the step carries. A request with any
processor is not speculated (a verify step's rows would each need their own); logprobs alone
are, exactly (`shards.sampling.logprob_entries` on the verify step's rows).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import numpy as np
from layersplit.shards.sampling_params import pack_bias, pack_mask

# The key of a step's sample fields whose value, a callable, gives the grammar mask after the step
# is sent (`Coordinator.send_step` sends `late_mask: true` in its place, then the mask).
LATE_MASK = "late_mask"


class TokenGrammar(Protocol):
    """A grammar that constrains one sequence's tokens (`runtime.grammar`)."""

    def mask(self, generated: Sequence[int]) -> bytes | None:
        """The packed mask (`shards.sampling_params.pack_mask`) of the tokens allowed after
        `generated` (the sequence's tokens so far); None: anything (it is done)."""


@dataclasses.dataclass(frozen=True)
class Decoding:
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    grammar: Any = None  # a factory: () -> TokenGrammar, one per sequence

    @property
    def processes(self) -> bool:
        """Some processor changes the logits (the request is then not speculated)."""
        return bool(self.processors)

    @property
    def processors(self) -> tuple[str, ...]:
        """The request fields whose processors change the logits (what keeps it from being
        speculated, said in logs and in the server's X-Layersplit-Speculation header)."""
        named = (("response_format/tool_choice grammar", self.grammar is not None),
                 ("presence_penalty", self.presence_penalty != 0.0),
                 ("frequency_penalty", self.frequency_penalty != 0.0),
                 ("repetition_penalty", self.repetition_penalty != 1.0),
                 ("logit_bias", bool(self.logit_bias)), ("min_tokens", self.min_tokens > 0))
        return tuple(name for name, on in named if on)


class ProcessorsTooLarge(ValueError):
    """A sequence's processors no longer fit in a step's header (`StepFields`)."""


class StepFields:
    """`sequence_program`'s `step_fields` for one sequence. `budget`: the bytes its fields may
    take in a step's header (every sequence of a step shares the header's room, `ipc.shm`):
    a sequence whose penalties or masks outgrow it fails with ProcessorsTooLarge, never a
    step of the whole batch."""

    def __init__(self, d: Decoding, prompt: Sequence[int], stop_ids: Collection[int],
                 vocab: int, budget: int) -> None:
        self.d, self.vocab, self.budget = d, vocab, budget
        self.seen = None
        if d.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab, dtype=bool)
            self.seen[np.array(sorted(set(prompt)), dtype=np.int64)] = True
        self.counted = 0  # generated tokens already in `seen`
        self.stop_ids = sorted(set(stop_ids))
        self.grammar = d.grammar() if d.grammar is not None else None

    def __call__(self, generated: Sequence[int]) -> dict | None:
        d, out = self.d, {}
        if d.logprobs is not None:
            out["lp"] = d.logprobs
        bias: dict[int, float] = collections.defaultdict(float)
        if d.presence_penalty or d.frequency_penalty:
            for t, c in collections.Counter(generated).items():
                bias[t] -= d.frequency_penalty * c + d.presence_penalty
        for t, v in d.logit_bias:
            bias[t] += v
        if len(generated) < d.min_tokens:
            for t in self.stop_ids:
                bias[t] = float("-inf")
        if bias:
            ids = sorted(bias)
            out["bias"] = pack_bias(ids, [bias[t] for t in ids])
        if self.seen is not None:
            new = list(generated[self.counted:])
            self.counted = len(generated)
            if new:
                self.seen[np.array(new, dtype=np.int64)] = True
            out["rep"] = d.repetition_penalty
            out["rep_mask"] = pack_mask(self.seen)
        if self.grammar is not None:  # (it needs no room in the step's header)
            out[LATE_MASK] = functools.partial(self.grammar.mask, generated)
        size = sum(len(v) for v in out.values() if isinstance(v, bytes))
        if size > self.budget:
            raise ProcessorsTooLarge(
                f"this request's penalties and logit_bias take {size} bytes a step "
                f"after {len(generated)} tokens, more than the {self.budget} one sequence may "
                "(fewer distinct tokens penalised, or a lower max_seqs, leaves more room)")
        return out or None
