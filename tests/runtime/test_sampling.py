"""Sampling is reproducible from (seed, position) and respects top-k / top-p."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.sampling import (
    SamplingParams,
    counter_uniform,
    exponential_noise,
    filtered_probs,
    mix_seed,
    sample_rows,
    sample_tokens,
    vocab_noise,
)

M64 = (1 << 64) - 1


def _splitmix64_uniform(key: int, i: int) -> float:
    """The reference: SplitMix64's i-th output for the seed `key`, in Python integers."""
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return ((z >> 12) + 0.5) * 2.0 ** -52


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


def test_the_noise_is_splitmix64_bit_for_bit():
    """The tensor version (int64 arithmetic, wrapping) against Python's integers, keys over the
    whole 63-bit range and ids past 2**32: a pure function, so every device that computes it
    (CPU, CUDA) draws the same tokens."""
    g = torch.Generator().manual_seed(3)
    keys = [mix_seed(s, p) for s, p in ((0, 0), (1, 7), (2**40 + 3, 123456), (7, 2**31))]
    ids = torch.randint(0, 2**40, (4, 50), generator=g)
    got = counter_uniform(keys, ids)
    want = torch.tensor([[_splitmix64_uniform(k, int(i)) for i in row]
                         for k, row in zip(keys, ids)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert bool(((got > 0) & (got < 1)).all())


def test_the_noise_is_exponential_and_the_same_at_any_subset_of_tokens():
    keys = [mix_seed(11, p) for p in range(4)]
    full = vocab_noise(keys, 50_000, "cpu")
    assert full.shape == (4, 50_000) and full.dtype == torch.float32
    flat = full.flatten().double()
    assert abs(float(flat.mean()) - 1) < 0.01 and abs(float(flat.var()) - 1) < 0.03
    # P(E > 1) = 1/e, P(E > 3) = e^-3: the tail as well as the mean
    assert abs(float((flat > 1).double().mean()) - 0.36788) < 0.005
    assert abs(float((flat > 3).double().mean()) - 0.04979) < 0.002
    ids = torch.tensor([[5, 49_999, 0], [17, 3, 3], [0, 1, 2], [40_000, 7, 8]])
    assert torch.equal(exponential_noise(keys, ids), full.gather(1, ids))
    # rows are independent streams: no two rows alike, nor a row and its shift
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[0, 1:], full[1, :-1])


def test_rows_sampled_together_equal_each_alone():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    together = sample_tokens(logits, 0.8, 40, 0.9, 9, [3, 4, 5, 9, 100]).tolist()
    alone = [sample_rows(logits[i:i + 1], 0.8, 40, 0.9, 9, [p])[0]
             for i, p in enumerate([3, 4, 5, 9, 100])]
    assert together == alone


def test_the_uniform_stays_inside_0_and_1_at_its_extremes():
    """All 64 bits set and none: inside (0, 1) (with the top 53 bits, all set rounded to 1.0)."""
    from layersplit.shards.sampling import _unit

    u = _unit(torch.tensor([-1, 0, 1 << 62], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all()) and float(u[0]) == 1 - 2.0 ** -53
    assert float((torch.tensor([(1 << 53) - 1]).double() + 0.5) * 2.0 ** -53) == 1.0  # (why)


def test_the_noise_refuses_rows_without_a_key():
    with pytest.raises(ValueError, match="one row per key"):
        counter_uniform([1, 2], torch.zeros(3, 4, dtype=torch.int64))
