"""What a request asks of decoding beyond `SamplingParams`: logprobs and logits processors.

The coordinator turns them, step by step, into the optional fields of the step's sample dict
(`shards.sampling`), which the last shard applies before it samples: presence and frequency
penalties (over the tokens generated so far), `logit_bias` and `min_tokens` become one additive
`bias`; the repetition penalty is `rep` over the prompt's and the generated tokens (as vLLM's);
a grammar (`runtime.grammar`) gives the `mask` of the tokens it allows next. A request with any
processor is not speculated (a verify step's rows would each need their own); logprobs alone
are, exactly (`shards.sampling.logprob_entries` on the verify step's rows).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, Protocol


class TokenGrammar(Protocol):
    """A grammar that constrains one sequence's tokens (`runtime.grammar`)."""

    def mask(self, generated: Sequence[int]) -> bytes | None:
        """The packed mask (`shards.sampling.pack_mask`) of the tokens allowed after
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
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.grammar is not None)


class StepFields:
    """`sequence_program`'s `step_fields` for one sequence."""

    def __init__(self, d: Decoding, prompt: Sequence[int], stop_ids: Collection[int]) -> None:
        self.d = d
        self.prompt_ids = sorted(set(prompt)) if d.repetition_penalty != 1.0 else []
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
            out["bias"] = [ids, [bias[t] for t in ids]]
        if d.repetition_penalty != 1.0:
            out["rep"] = d.repetition_penalty
            out["rep_ids"] = sorted(set(self.prompt_ids).union(generated))
        if self.grammar is not None:
            mask = self.grammar.mask(generated)
            if mask is not None:
                out["mask"] = mask
        return out or None
