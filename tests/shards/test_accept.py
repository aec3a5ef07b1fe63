"""Verifying draft tokens (`accept_draft`): greedy keeps the longest matching prefix plus the
target's next token; sampling keeps the target's own distribution (a statistical test on a tiny
vocabulary) and equals plain sampling draw for draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shards.sampling import accept_draft, filtered_probs, sample_rows

# chi-square critical values at p = 1e-4, by degrees of freedom 1..4
CHI2_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}


def test_greedy_keeps_the_matching_prefix_and_the_bonus():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5.0, 0, 0, 0], [0, 0, 0, 5]])
    assert accept_draft(logits, [1, 2, 0], 0.0, 0, 1.0, 0, 10) == (3, 3)  # all kept + bonus
    assert accept_draft(logits, [1, 3, 0], 0.0, 0, 1.0, 0, 10) == (1, 2)  # second differs
    assert accept_draft(logits, [2, 2, 0], 0.0, 0, 1.0, 0, 10) == (0, 1)
    with pytest.raises(ValueError):
        accept_draft(logits, [1, 2], 0.0, 0, 1.0, 0, 10)


def test_sampled_verification_equals_plain_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    for seed in range(200):
        plain = sample_rows(logits, 0.9, 20, 0.9, seed, [11, 12, 13, 14, 15])
        for draft in ([plain[0], plain[1], 3, 4], plain[:4], [7, 7, 7, 7]):
            k, tok = accept_draft(logits, draft, 0.9, 20, 0.9, seed, 10)
            assert draft[:k] == plain[:k] and tok == plain[k]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_target_distribution_is_preserved(temperature, top_p):
    """Over many seeds, the first token emitted after verifying a fixed draft follows the
    target's (filtered) distribution, whatever the draft proposes; the second token, given the
    first was the draft's, follows the target's second row (chi-square, p > 1e-4)."""
    logits = torch.tensor([[1.0, 0.3, -0.5, 0.8, 0.0], [0.2, 1.5, -1.0, 0.0, 0.4],
                           [0.0, 0.0, 0.0, 0.0, 0.0]])
    p0 = filtered_probs(logits[0:1], temperature, 0, top_p)[0].numpy()
    p1 = filtered_probs(logits[1:2], temperature, 0, top_p)[0].numpy()
    draft = [3, 1]  # the draft's guesses for both positions
    first, second = np.zeros(5), np.zeros(5)
    n = 20000
    for seed in range(n):
        k, tok = accept_draft(logits, draft, temperature, 0, top_p, seed, 100)
        first[draft[0] if k >= 1 else tok] += 1
        if k >= 1:
            second[draft[1] if k >= 2 else tok] += 1
    for counts, p in ((first, p0), (second, p1)):
        keep = p > 0
        assert counts[~keep].sum() == 0
        expected = counts.sum() * p[keep]
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_1E4[int(keep.sum()) - 1], (counts, p)
