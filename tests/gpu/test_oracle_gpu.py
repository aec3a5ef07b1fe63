"""The bench oracle at a real shape (run on a CUDA machine: `python -m pytest -m gpu`): the
Qwen3-8B shape with a random-weight draft of z-lab's Qwen3-8B-DFlash-b16 shape, 1 shard. Its
accepted tokens are plain decoding's and its measured acceptance is A within 0.1.

`deterministic = true`: a verify step's rows then round as plain decode steps do, so equal
tokens are a property of the oracle and the runtime, not of near-ties of random weights (the
default mode's rows may round otherwise, `docs/speculative.md`, Exactness)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from layersplit.draft.oracle_table import ORACLE_ENV
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

from tests.helpers import oracle_acceptance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

A = 6.3
# 1 + 126 tokens: the first from the prefill, then 20 verify steps that end on the oracle's
# lattice (seed 0: floor(20 * 6.3 + 0.84) = 126), none cut short by the end
GREEDY = SamplingParams(max_tokens=127, ignore_eos=True)


def test_oracle_at_the_qwen3_8b_shape(tmp_path, monkeypatch):
    rng = random.Random(0)
    prompts = [[rng.randrange(151936) for _ in range(64)] for _ in range(4)]
    cfg = RuntimeConfig(model="random:qwen3-8b", devices=("cuda:0",), max_context=1024,
                        deterministic=True, draft="none", prefix_cache=False)
    with Coordinator(cfg) as coord:
        plain = [coord.generate(p, GREEDY, use_cache=False).tokens for p in prompts]
    table = tmp_path / "oracle.json"
    table.write_text(json.dumps({"acceptance": A, "seed": 0,
                                 "sequences": [p + t for p, t in zip(prompts, plain)]}))
    monkeypatch.setenv(ORACLE_ENV, str(table))
    cfg = RuntimeConfig(model="random:qwen3-8b", devices=("cuda:0",), max_context=1024,
                        deterministic=True, draft="random:qwen3-8b-dflash-b16",
                        prefix_cache=False, spec_policy="on")  # (every step a whole round:
    # under `auto` the measured policy shortens rounds or decodes plainly, off the lattice)
    with Coordinator(cfg) as coord:
        assert coord.draft_info["bench_oracle"] == A and coord.draft_info["block_size"] == 16
        acceptance = oracle_acceptance(coord, prompts, plain, GREEDY)
    assert abs(acceptance - A) <= 0.1, acceptance
