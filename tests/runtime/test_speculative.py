"""runtime/speculative.py's pure helpers: which verify steps the warm-up at start captures."""

from __future__ import annotations

from layersplit.runtime.speculative import warm_verify_rows


def test_warm_rows_of_a_dense_target_take_chains_trees_and_policy_sizes():
    assert warm_verify_rows(8, 31, (31, 15, 7, 3), hybrid=False) == [4, 8, 16, 32]
    assert warm_verify_rows(16, 0, (), hybrid=False) == [16]


def test_warm_rows_of_a_hybrid_target_take_chain_lengths_only():
    """A hybrid target's tree steps run row by row: no graph (nor keep buffers) for them, not
    even for a tree no larger than the chain (the policy's sizes are the tree's then)."""
    assert warm_verify_rows(8, 31, (31, 15, 7, 3), hybrid=True) == [8]
    assert warm_verify_rows(16, 7, (7, 3), hybrid=True) == [16]
    assert warm_verify_rows(16, 0, (15, 7), hybrid=True) == [8, 16]


def test_warm_rows_without_a_chain_to_verify_are_none():
    assert warm_verify_rows(1, 0, (), hybrid=False) == []
