"""`split = "auto"`: shards balanced by weight bytes (MoE and dense layers differ; the embedding
and the LM head count), not by layer count."""

from __future__ import annotations

import argparse

import pytest
from layersplit.runtime.config import ConfigError, add_flags, from_args, from_mapping
from layersplit.runtime.placement import (
    PlacementError,
    bytes_split,
    describe_split,
    even_split,
    plan,
)
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.tiny import FAMILY_CONFIGS
from layersplit.shards.weights import layer_bytes


def _largest(counts: list[int], costs: list[int], first: int, last: int) -> int:
    out, a = [], 0
    for c in counts:
        b = a + c
        out.append(sum(costs[a:b]) + (first if a == 0 else 0) + (last if b == len(costs) else 0))
        a = b
    return max(out)


def test_bytes_split_balances_bytes():
    assert bytes_split([1] * 6, 2) == [3, 3]
    assert bytes_split([1] * 6, 3) == [2, 2, 2]
    assert bytes_split([1] * 6, 2, first=4) == [1, 5]  # the embedding weighs 4 layers
    assert bytes_split([1] * 6, 2, last=2) == [4, 2]
    assert bytes_split([10, 1, 1, 1, 1, 10], 2) == [3, 3]
    assert bytes_split([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 9]
    assert bytes_split([5], 1) == [1]
    with pytest.raises(PlacementError):
        bytes_split([1, 1], 3)


def test_bytes_split_is_optimal():
    """No other contiguous split has a smaller largest shard (brute force over all splits)."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        if k > n:
            continue
        costs = [rng.randint(1, 20) for _ in range(n)]
        first, last = rng.randint(0, 30), rng.randint(0, 30)
        got = bytes_split(costs, k, first, last)
        assert sum(got) == n and min(got) >= 1
        best = min(_largest([b - a for a, b in zip((0, *cuts), (*cuts, n))], costs, first, last)
                   for cuts in itertools.combinations(range(1, n), k - 1))
        assert _largest(got, costs, first, last) == best


def test_auto_split_of_a_moe_model_by_bytes():
    """Qwen2-MoE's sparse layers (odd) outweigh its dense ones: 3 shards by bytes differ from
    3 by layer count, and their largest shard is smaller."""
    cfg = config_from_hf({**FAMILY_CONFIGS["qwen2_moe"], "num_hidden_layers": 12,
                          "vocab_size": 4000}, "c")
    sizes = layer_bytes(cfg, 4)
    costs, first, last = sizes
    assert costs[1] > 1.5 * costs[0]  # a sparse layer holds all its experts
    assert first == 4000 * 64 * 4 and last == first + 64 * 4  # tied: the head is a copy
    rc = from_mapping({"devices": ["cpu"] * 3, "split": "auto"}, "t")
    p = plan(rc, 12, sizes)
    counts = [s.end - s.start for s in p.shards]
    assert counts != even_split(12, 3)
    assert _largest(counts, *sizes) < _largest(even_split(12, 3), *sizes)
    shown = describe_split(p, sizes)
    assert shown.startswith("0:") and shown.count(" MB)") == 3
    with pytest.raises(PlacementError, match="layer sizes"):
        plan(rc, 12)


def test_split_auto_from_flags_and_files():
    p = argparse.ArgumentParser()
    add_flags(p)
    assert from_args(p.parse_args(["--split", "auto"])).split == "auto"
    assert from_args(p.parse_args(["--split", "3,3"])).split == (3, 3)
    assert from_mapping({"split": "auto"}, "c.toml").split == "auto"
    with pytest.raises(ConfigError, match="split='fast' is not a valid int"):
        from_mapping({"split": "fast"}, "c.toml")
