"""Verifying draft tokens (`accept_draft`): greedy keeps the longest matching prefix plus the
target's next token; sampling keeps the target's own distribution (a statistical test on a tiny
vocabulary) and equals plain sampling draw for draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layersplit.shards.accept import accept_draft
from layersplit.shards.sampling import filtered_probs, sample_rows

# chi-square critical values at p = 1e-4, by degrees of freedom 1..4
CHI2_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}


def test_greedy_keeps_the_matching_prefix_and_the_bonus():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5.0, 0, 0, 0], [0, 0, 0, 5]])
    assert accept_draft(logits, [1, 2, 0], 0.0, 0, 1.0, 0, 10) == ([1, 2, 3], 3)  # all + bonus
    assert accept_draft(logits, [1, 3, 0], 0.0, 0, 1.0, 0, 10) == ([1], 2)  # second differs
    assert accept_draft(logits, [2, 2, 0], 0.0, 0, 1.0, 0, 10) == ([], 1)
    with pytest.raises(ValueError):
        accept_draft(logits, [1, 2], 0.0, 0, 1.0, 0, 10)


def test_sampled_verification_equals_plain_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    for seed in range(200):
        plain = sample_rows(logits, 0.9, 20, 0.9, seed, [11, 12, 13, 14, 15])
        for draft in ([plain[0], plain[1], 3, 4], plain[:4], [7, 7, 7, 7]):
            path, tok = accept_draft(logits, draft, 0.9, 20, 0.9, seed, 10)
            k = len(path)
            assert path == list(range(1, k + 1))
            assert draft[:k] == plain[:k] and tok == plain[k]


@pytest.mark.slow
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
        path, tok = accept_draft(logits, draft, temperature, 0, top_p, seed, 100)
        k = len(path)
        first[draft[0] if k >= 1 else tok] += 1
        if k >= 1:
            second[draft[1] if k >= 2 else tok] += 1
    for counts, p in ((first, p0), (second, p1)):
        keep = p > 0
        assert counts[~keep].sum() == 0
        expected = counts.sum() * p[keep]
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_1E4[int(keep.sum()) - 1], (counts, p)


def test_a_tree_keeps_the_branch_the_target_takes():
    """Rows: 0 root; 1 (token 1) and its child 2 (token 2); 3 (token 2), a second candidate for
    the first position, and its child 4 (token 0). The target's argmax per row decides."""
    parents = [0, 1, 0, 3]
    draft = [1, 2, 2, 0]
    logits = torch.full((5, 4), -5.0)
    for row, tok in enumerate([2, 0, 1, 0, 3]):  # the target's token after each row
        logits[row, tok] = 5.0
    assert accept_draft(logits, draft, 0.0, 0, 1.0, 0, 10, parents) == ([3, 4], 3)
    logits[0] = torch.tensor([0.0, 5, 0, 0])  # now the first candidate, whose child is wrong
    assert accept_draft(logits, draft, 0.0, 0, 1.0, 0, 10, parents) == ([1], 0)
    logits[0] = torch.tensor([0.0, 0, 0, 5])  # neither
    assert accept_draft(logits, draft, 0.0, 0, 1.0, 0, 10, parents) == ([], 3)


def test_sampled_tree_verification_equals_plain_sampling():
    """Every token a tree verify step emits is the draw plain sampling makes at its position,
    whichever branch holds it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 6, generator=g).repeat(7, 1)  # one distribution for every row
    parents = [0, 1, 0, 3, 0, 5]  # three branches of depth 2
    for seed in range(300):
        plain = sample_rows(logits[:2], 1.0, 0, 1.0, seed, [11, 12])
        draft = [(plain[0] + 1) % 6, 0, plain[0], plain[1], (plain[0] + 2) % 6, 1]
        path, tok = accept_draft(logits, draft, 1.0, 0, 1.0, seed, 10, parents)
        assert path == [3, 4]
        assert tok == sample_rows(logits[:1], 1.0, 0, 1.0, seed, [13])[0]
