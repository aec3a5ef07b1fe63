"""Seeded random weights (`random:NAME`): a seed names one set of tensors, on a CPU too."""

from __future__ import annotations

import torch
from layersplit.shards.random_weights import RandomCheckpoint
from layersplit.shards.tiny import write_tiny_checkpoint


def test_seeds_give_different_tensors_and_a_seed_the_same(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    name, shape = "model.layers.0.mlp.down_proj.weight", (8, 16)

    def draw(seed: int) -> torch.Tensor:
        return RandomCheckpoint(folder, seed).tensor(name, shape, torch.float32, "cpu")

    assert torch.equal(draw(0), draw(0)) and torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(0), draw(1))
    assert not torch.equal(draw(1), draw(2))  # (a seed's high bits alone once told them apart)
