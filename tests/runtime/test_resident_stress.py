"""Resident prefixes under load: concurrent requests with common prefixes, exact repeats and
continued conversations in a small pool with swaps and re-prefills; every output equals the
reference's logits bit for bit, and the pool's counts stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.generate import Progress
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_logged

CHUNK = 16
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("host", [0, 24])
def test_resident_prefixes_under_preemption(tiny_llama, host):
    ref = ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=128)
    enc = ref.tokenizer.encode
    base = enc("a shared system prompt that every request starts with, and then")
    tails = [enc(" first question here"), enc(" a second, other question"),
             enc(" third"), enc(" a fourth longer question with more words in it")]
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu",) * 2, prefill_chunk=CHUNK,
                        threads=1, max_context=128, kv_block=8, kv_blocks=24, max_seqs=3,
                        kv_host_blocks=host)
    with Coordinator(cfg) as c:
        convo = [base + t for t in tails]
        for rnd in range(6):
            prompts = [convo[(rnd + i) % len(convo)] for i in range(3)]
            progress = [Progress(logits=[]) for _ in prompts]
            before = c.batcher.stats.reprefills
            got = c.generate_batch(prompts, [GREEDY] * 3, progress=progress)
            for p, r, pr in zip(prompts, got, progress):
                want = run_logged(ref, p, GREEDY)
                assert r.tokens == want[0].tokens, f"round {rnd}"
                if c.batcher.stats.reprefills == before:  # (a re-prefill computes the rows it
                    # decoded by prefill: other last bits)
                    assert_same_run((r, np.stack(pr.logits)), want, f"round {rnd}")
            c.batcher.sched.check()
            for i, p in enumerate(prompts):  # the conversation goes on (some repeat exactly)
                j = convo.index(p)
                if (rnd + i) % 2:
                    convo[j] = p + got[i].tokens[:5]
        b = c.batcher
        assert c.cache.stats.hits_resident > 0 and b.sched.resident.evicted > 0
        assert b.stats.preemptions > 0
