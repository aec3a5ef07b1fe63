"""A block draft's token tree (`draft.tree_shape`): the shape read from config.json (a bad one is
refused by name), made into tokens and parents from the draft's candidates, and chosen from how
often the target's token had each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layersplit.draft.measure import walk
from layersplit.draft.tree_shape import choose_shape, instantiate, read_shape
from layersplit.shards.errors import CheckpointError
from layersplit.shards.spec_tree import check_tree

SHAPE = [[0], [1], [0, 0], [0, 0, 0], [1, 0], [0, 1], [2]]


def test_a_shape_becomes_a_preorder_tree_of_candidates():
    top = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # rank r at draft position d: 10 d + r
    shape = read_shape(SHAPE, 4, Path("config.json"))
    tokens, parents = instantiate(shape, top, 7, 3)
    check_tree(parents, 7)
    # depth-first: (0) (0,0) (0,0,0) (0,1) (1) (1,0) (2)
    assert tokens == [10, 20, 30, 21, 11, 20, 12]
    assert parents == [0, 1, 2, 1, 0, 5, 0]
    # the first 3 paths by priority, and no deeper than 1: what the room allows
    assert instantiate(shape, top, 3, 3) == ([10, 20, 11], [0, 1, 0])
    assert instantiate(shape, top, 7, 1) == ([10, 11, 12], [0, 0, 0])
    assert instantiate(shape, top, 1, 3) == ([10], None)  # a chain


@pytest.mark.parametrize("raw,why", [
    ([], "non-empty list"),
    ([[0], [0, 0, 0, 0]], "is not a list of 1..3 ranks"),
    ([[0], [-1]], "is not a list of 1..3 ranks"),
    ([[0, 0], [0]], "comes before its parent"),
    ([[0], [0]], "is repeated"),
    ("all", "non-empty list"),
])
def test_a_malformed_shape_is_refused_by_name(raw, why):
    with pytest.raises(CheckpointError, match=f"config.json: .*{why}"):
        read_shape(raw, 4, Path("config.json"))


def test_the_shape_is_the_most_often_right_paths():
    ranks = [torch.tensor([[0, 0, 1], [1, 0, 0], [0, 0, 0], [0, 2, 0], [1, 3, 3], [3, 0, 0]])]
    shape = choose_shape(ranks, 5, k=3)  # rank 3: not among the top 3
    # counts: (0) 3; (1) 2, (0,0) 2; (0,2) 1, (1,0) 1; deeper ones 1 ((1,3): not in the top 3)
    assert shape == [[0], [1], [0, 0], [0, 2], [1, 0]]
    read_shape(shape, 4, Path("config.json"))  # a valid tree at every prefix
    chain = [[0], [0, 0], [0, 0, 0]]
    # walking one sequence: anchors 0 (0,0,1) keeps 2 -> anchor 3 (0,2,0) keeps 1 -> anchor 5
    assert walk(ranks, chain) == (3 + 2 + 1) / 3
    # anchor 0 keeps (0,0) -> anchor 3 keeps (0,2) -> the end
    assert walk(ranks, shape) == (3 + 3) / 2
