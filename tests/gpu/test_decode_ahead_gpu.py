"""Decode lookahead on a GPU (`shards.decode_ahead`: tokens kept and filled on the device,
results sent once their page-locked copies land; on two shards, through the token board the
last shard shares with the first by CUDA IPC, `ipc.token_board`): the same tokens and
bit-identical logits as the step-by-step loop, greedy and sampled; a batch with stops, each row
alone (`deterministic`, so the batch's shape cannot round a near-tie differently), the same; for
a dense model and a hybrid one (whose recurrent state a dropped row past a stop has advanced,
in a slot the next request then takes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

from tests.helpers import run_logged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(model, ahead: bool, prompts, params, shards: int = 1, **kw):
    cfg = RuntimeConfig(model=str(model), devices=("cuda:0",) * shards, max_context=256,
                        max_seqs=3, decode_ahead=ahead, **kw)
    with Coordinator(cfg) as c:
        if shards > 1 and ahead:  # (tokens through device memory, not the host)
            assert c.board
        logged = [run_logged(c, prompts[0], p) for p in params]
        batch = [r.tokens for r in c.generate_batch(prompts, params, use_cache=False)]
        return logged, batch, c.batcher.stats.ahead


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_lookahead_equals_step_by_step_on_a_gpu(tiny_llama, hybrid_models, family, shards):
    model = tiny_llama if family == "llama" else hybrid_models[family]
    prompts = [list(range(3 + i, 40 + 2 * i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    plain = _run(model, False, prompts, [greedy] * 3, deterministic=True)[1][2]
    at = next(i for i in range(6, len(plain)) if plain[i] not in plain[:i])
    stop = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[plain[at]])
    params = [greedy, sampled, stop]
    on = _run(model, True, prompts, params, shards, deterministic=True)
    off = _run(model, False, prompts, params, shards, deterministic=True)
    assert on[2] > 20 and off[2] == 0
    for (r_on, l_on), (r_off, l_off) in zip(on[0], off[0]):
        assert r_on.tokens == r_off.tokens
        assert np.array_equal(l_on, l_off)
    assert on[1] == off[1]
    assert len(on[1][2]) == at
