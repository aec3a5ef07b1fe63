"""The last shard's early moves of kept tree rows (`shards.early_moves`) on a real executor's
paged pool: each sequence's rows move once, whether the step after them comes alone or with
others; a failed early move fails that sequence's next step by name, not another sequence's;
hybrid models move with their next step. (`tests/shards/test_kept_rows.py` runs the same
through the split runtime.)"""

from __future__ import annotations

import logging

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.early_moves import EarlyMoves
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.spec_tree import kept_moves


def _executor(path) -> RangeExecutor:
    ex = RangeExecutor(load_layer_range(open_checkpoint(path), 0, 2), 64, slots=3, paged=(12, 8))
    for slot, blocks in enumerate(([4, 0, 7], [1, 9, 2, 5], [11, 3])):
        ex.kv.set_table(slot, 0, blocks)
    g = torch.Generator().manual_seed(0)
    ex.kv.k_store.copy_(torch.randn(ex.kv.k_store.shape, generator=g))
    ex.kv.v_store.copy_(torch.randn(ex.kv.v_store.shape, generator=g))
    return ex


def _seg(slot: int, pos: int, draft: list[int] | None, kept: list[int] | None = None) -> dict:
    return {"slot": slot, "pos": pos, "draft": draft, "kept": kept}


def test_kept_rows_move_once_for_each_sequence_of_a_step(tiny_llama):
    ex, want = _executor(tiny_llama), _executor(tiny_llama)
    # a step of three sequences: two trees keeping branches off their first path ([2, 3]
    # moves row 3 onto the row 2 the first move read), one plain decode segment
    seqs = [_seg(0, 10, [5, 6, 7, 8]), _seg(1, 20, [5, 6, 7, 8]), _seg(2, 4, None)]
    results = [{"accepted": 2, "path": [2, 3]}, {"accepted": 2, "path": [2, 4]},
               {"accepted": 0, "path": None}]
    early = EarlyMoves()
    early.after_sampling(ex, seqs, results)
    want.kv.move_rows_many([(0, *kept_moves(13, [2, 3])), (1, *kept_moves(23, [2, 4]))])
    assert torch.equal(ex.kv.k_store, want.kv.k_store)
    assert torch.equal(ex.kv.v_store, want.kv.v_store)
    # their next steps (and a new sequence's in slot 2) carry the kept rows: nothing moves again
    nxt = [_seg(1, 23, None, [2, 4]), _seg(0, 13, None, [2, 3]), _seg(2, 0, None)]
    moves = early.for_step(nxt)
    assert moves == [(1, 23, None), (0, 13, None), (2, 0, None)]
    ex.before_steps(moves)
    assert torch.equal(ex.kv.k_store, want.kv.k_store)
    # the records went with those steps: a later step with kept rows moves them itself
    assert early.for_step([_seg(0, 13, None, [2, 3])]) == [(0, 13, [2, 3])]
    # a chain's path is where its rows are already: nothing recorded
    early.after_sampling(ex, [_seg(0, 30, [5, 6])], [{"accepted": 2, "path": [1, 2]}])
    assert early.done == {} and early.for_step([_seg(0, 33, None)]) == [(0, 33, None)]


def test_a_failed_early_move_fails_that_sequences_next_step_by_name(tiny_llama, monkeypatch,
                                                                     caplog):
    ex = _executor(tiny_llama)
    real = ex.kv.move_rows_many

    def half(moves):  # some K rows written, then a failure
        rows = ex.kv._pool_rows(moves[0][0], moves[0][2])
        ex.kv.k_rows[:, rows] = 0.0
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(ex.kv, "move_rows_many", half)
    early = EarlyMoves()
    tree = [5, 6, 7, 8]
    with caplog.at_level(logging.WARNING):
        early.after_sampling(ex, [_seg(0, 10, tree), _seg(1, 20, tree)],
                             [{"accepted": 2, "path": [2, 3]}, {"accepted": 2, "path": [2, 4]}],
                             "shard 1")
    assert "shard 1: kept rows of slots [0, 1] not moved" in caplog.text
    assert "CUDA out of memory" in caplog.text and early.done == {}
    # another slot's step goes on, and leaves the failures where they are
    assert early.for_step([_seg(2, 5, None)]) == [(2, 5, None)] and set(early.failed) == {0, 1}
    # each failed sequence's next step fails by name, alone or with the other
    with pytest.raises(RuntimeError, match="slot 0: the kept rows of its last verify step "
                                           "could not be moved.*CUDA out of memory"):
        early.for_step([_seg(0, 13, None, [2, 3])])
    assert set(early.failed) == {1}
    with pytest.raises(RuntimeError, match="slot 1: the kept rows"):
        early.for_step([_seg(2, 6, None), _seg(1, 23, None, [2, 4])])
    assert early.failed == {} and early.done == {}
    # a new sequence in a slot whose last one stopped after a failed move starts clean
    early.after_sampling(ex, [_seg(0, 10, tree)], [{"accepted": 2, "path": [2, 3]}])
    assert early.for_step([_seg(0, 0, None)]) == [(0, 0, None)] and early.failed == {}
    # done records match position and rows both: anything else moves
    monkeypatch.setattr(ex.kv, "move_rows_many", real)
    early.after_sampling(ex, [_seg(0, 10, tree)], [{"accepted": 2, "path": [2, 3]}])
    assert early.for_step([_seg(0, 13, None, [2, 4])]) == [(0, 13, [2, 4])]


def test_hybrid_models_move_kept_rows_with_their_next_step(hybrid_models):
    ex = RangeExecutor(load_layer_range(open_checkpoint(hybrid_models["qwen3_5"]), 0, 2), 64)
    early = EarlyMoves()
    early.after_sampling(ex, [_seg(0, 10, [5, 6, 7])], [{"accepted": 2, "path": [2, 3]}])
    assert early.done == {} and early.failed == {}
    assert early.for_step([_seg(0, 13, None, [2, 3])]) == [(0, 13, [2, 3])]
