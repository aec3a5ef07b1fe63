"""Sampling is reproducible from (seed, position) and respects top-k / top-p."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.sampling import SamplingParams, filtered_probs, sample_rows


def test_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert sample_rows(logits, 0.0, 0, 1.0, 0, [1, 2, 3]) == logits.argmax(-1).tolist()


def test_seed_and_position_determine_the_draw():
    logits = torch.zeros(1, 1000)
    a = [sample_rows(logits, 1.0, 0, 1.0, 42, [p])[0] for p in range(20)]
    b = [sample_rows(logits, 1.0, 0, 1.0, 42, [p])[0] for p in range(20)]
    c = [sample_rows(logits, 1.0, 0, 1.0, 43, [p])[0] for p in range(20)]
    assert a == b and a != c and len(set(a)) > 10


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    seen_k = {sample_rows(logits, 2.0, 2, 1.0, s, [0])[0] for s in range(200)}
    assert seen_k == {0, 1}
    p = filtered_probs(logits, 1.0, 0, 0.7)
    assert p[0, 0] > 0 and p[0, 1] > 0 and p[0, 2:].sum() == 0  # 0.64 + 0.24 reaches 0.7
    assert abs(p.sum().item() - 1) < 1e-6


def test_sampling_matches_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None]
    n = 3000
    counts = torch.bincount(torch.tensor(
        [sample_rows(logits, 1.0, 0, 1.0, 7, [p])[0] for p in range(n)]), minlength=3)
    assert torch.allclose(counts.float() / n, probs, atol=0.04)


@pytest.mark.parametrize("kw,field", [({"max_tokens": -1}, "max_tokens"),
                                      ({"temperature": -0.5}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_k": -3}, "top_k")])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
