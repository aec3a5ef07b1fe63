"""Grammar masks computed while their step runs: the coordinator sends the step, then the mask
straight to the last shard (`late_mask`), which samples once it has it. The constrained output
is the reference's under the same masks, on 1 and 2 shards, with the mask early or late, next
to unconstrained sequences of the same batch; a bad mask message is refused by name."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import pytest
from layersplit.ipc.messages import message
from layersplit.ipc.sockets import recv, send
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.decoding import Decoding
from layersplit.runtime.generate import Progress, collect
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams, mask_bits

if TYPE_CHECKING:  # (imported by the test: llguidance's import takes seconds, and a run of the
    # fast tier, which deselects it, would pay them when it collects this module)
    from layersplit.runtime.grammar import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "c": {"enum": ["red", "green"]}},
          "required": ["n", "c"], "additionalProperties": False}
PARAMS = SamplingParams(max_tokens=20)
PROMPT = "the cat sat on the mat and"


class SlowGrammar:
    """A matcher whose masks come after the step reached the last shard (a step of the tiny
    model takes a few ms)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def mask(self, generated):
        time.sleep(0.02)
        return self.inner.mask(generated)


def _reference(target, comp: GrammarCompiler, grammar: str, prompt: list[int],
               eos: set[int]) -> list[int]:
    ref = ReferenceEngine(target, prefill_chunk=16, max_context=256)
    m, gen = comp.matcher(grammar), []
    while len(gen) < PARAMS.max_tokens:
        row = ref.logits(prompt + gen)[-1].float()
        row[~mask_bits(m.mask(gen), row.shape[-1], row.device)] = float("-inf")
        gen.append(int(row.argmax()))
        if gen[-1] in eos:
            break
    return gen


def _run(coord, prompt, decodings) -> list[list[int]]:
    """One batch: a sequence per decoding (None: free text); their generated tokens."""
    progress = [Progress() for _ in decodings]
    reqs = [coord.submit(prompt, PARAMS, p, use_cache=False, decoding=d)
            for p, d in zip(progress, decodings, strict=True)]
    streams = [coord.deltas(r) for r in reqs]
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            if next(streams[i], None) is None:
                live.remove(i)
    return [collect(iter(()), p, len(prompt)).tokens for p in progress]


@pytest.mark.slow
def test_late_masks_give_the_reference_constrained_output(target):
    from layersplit.runtime.grammar import GrammarCompiler

    want = None
    for shards in (1, 2):
        cfg = RuntimeConfig(model=str(target), devices=("cpu",) * shards, prefill_chunk=16,
                            max_context=256, threads=1, draft="none", max_seqs=4)
        with Coordinator(cfg) as coord:
            comp = GrammarCompiler(coord.tokenizer, coord.model_config.vocab_size,
                                   coord.eos_ids)
            grammar = comp.json_schema(SCHEMA)
            prompt = coord.tokenizer.encode(PROMPT)
            if want is None:
                want = _reference(target, comp, grammar, prompt, set(coord.eos_ids))
                assert coord.tokenizer.decode(want).startswith('{"n":')
            early = Decoding(grammar=functools.partial(comp.matcher, grammar))
            late = Decoding(grammar=lambda m=comp.matcher, g=grammar: SlowGrammar(m(g)))
            free = coord.generate(prompt, PARAMS, use_cache=False).tokens
            got = _run(coord, prompt, [early, None, late])
            assert got == [want, free, want], shards
            # a bad mask message is refused, naming what was wrong; the runtime goes on
            last = coord.shards[-1].sock
            send(last, message("mask", sid=10**9, seg=0, mask=b"not zlib"))
            reply = {"type": "wake"}
            while reply["type"] == "wake":  # (a ring's doorbell may come first: the
                assert last.poll(10_000)  # coordinator skips those, as here)
                _, reply, _, _ = recv(last)
            assert reply["type"] == "error" and "mask" in reply["message"], reply
            assert _run(coord, prompt, [early]) == [want]
            # an exact prefix-cache hit draws its first token from stored logits, mask and all
            for d in (early, late):
                progress = Progress()
                req = coord.submit(prompt, PARAMS, progress, use_cache=True, decoding=d)
                assert collect(coord.deltas(req), progress, len(prompt)).tokens == want
            assert progress.cached_tokens == len(prompt)  # (the second: a hit)
            assert coord.failed is None
