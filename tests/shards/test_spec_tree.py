"""Token trees of verify steps (`shards.spec_tree`): their checks, and the verify step over a
tree computes for every row exactly what plain decoding computes at that row's position, its
kept rows moved into place (rowwise on the CPU, as one step under a tree mask otherwise)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.spec_tree import (
    ancestors,
    check_path,
    check_proposal,
    check_tree,
    depths,
    kept_moves,
)

PARENTS = [0, 1, 1, 0, 4, 5, 0]  # rows 1-2-(3) | 4-5-6 | 7 under the root


def test_tree_shape_helpers():
    check_tree(PARENTS, 7)
    assert depths(PARENTS) == [0, 1, 2, 2, 1, 2, 3, 1]
    anc = ancestors(PARENTS)
    assert anc[6].nonzero().flatten().tolist() == [0, 4, 5, 6]
    assert anc[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert kept_moves(20, [4, 5, 6]) == ([20, 21, 22], [17, 18, 19])  # verify step at 16
    assert kept_moves(13, [1, 2]) == ([], [])


@pytest.mark.parametrize("parents,why", [
    ([0, 2], "parent 2 is not on the path"),      # a parent after its child
    ([0, 1, 0, 2], "parent 2 is not on the path"),  # row 2's subtree closed before row 4
    ([0], "needs 2 parents"),
    ([0, True], "parent True"),
])
def test_malformed_trees_are_refused(parents, why):
    with pytest.raises(ValueError, match=why):
        check_tree(parents, max(len(parents), 2))


def test_malformed_kept_paths_are_refused():
    check_path([1, 3], 10)
    for bad in ([3, 1], [0], [2, 2], [1, "2"]):
        with pytest.raises(ValueError, match="not an increasing path"):
            check_path(bad, 10)


@pytest.mark.parametrize("static", [False, True], ids=["rowwise", "tree-mask step"])
def test_tree_verify_rows_equal_plain_decode_rows(target, static):
    """Each row's logits equal a plain decode step's at that row's position after its branch;
    after the kept path is moved, the KV rows equal the plain ones (the next step sees them)."""
    ckpt = open_checkpoint(target)
    model = load_layer_range(ckpt, 0, ckpt.config.num_layers)
    prompt = torch.tensor([5, 9, 13, 2, 7, 11, 3, 8])
    tokens = [4, 6, 12, 6, 10, 14, 1, 15]  # root + 7 draft tokens, rows of PARENTS
    tree = RangeExecutor(model, 64, static_decode=static)
    tree.run(prompt, 0)
    pos = len(prompt)
    got = tree.run(torch.tensor(tokens), pos, all_logits=True, verify=True, tree=PARENTS)
    anc = ancestors(PARENTS)
    for row in range(len(tokens)):
        plain = RangeExecutor(model, 64)
        plain.run(prompt, 0)
        branch = anc[row].nonzero().flatten().tolist()
        for i, r in enumerate(branch):
            out = plain.run(torch.tensor([tokens[r]]), pos + i)
        tol = 1e-4 if static else 0  # rowwise is bit-exact; one masked step rounds apart
        torch.testing.assert_close(got[row], out[-1], atol=tol, rtol=tol)
    path = [4, 5, 6]
    tree.kv.move_rows(0, *kept_moves(pos + 4, path))
    plain = RangeExecutor(model, 64)
    plain.run(prompt, 0)
    for i, r in enumerate([0, *path]):
        plain.run(torch.tensor([tokens[r]]), pos + i)
    for layer in range(model.num_layers):
        torch.testing.assert_close(tree.kv.k[layer, 0, :pos + 4], plain.kv.k[layer, 0, :pos + 4],
                                   atol=1e-5 if static else 0, rtol=1e-4 if static else 0)


def test_eager_tree_step_equals_rowwise(target):
    """The eager tree step (a GPU verify step longer than the graphs take) against the rowwise
    one: the same rows, and the same K/V at rows pos + j."""
    ckpt = open_checkpoint(target)
    model = load_layer_range(ckpt, 0, ckpt.config.num_layers)
    prompt = torch.tensor([5, 9, 13, 2, 7, 11, 3, 8])
    tokens = torch.tensor([4, 6, 12, 6, 10, 14, 1, 15])
    pos = len(prompt)
    rowwise = RangeExecutor(model, 64)
    rowwise.run(prompt, 0)
    want = rowwise.run(tokens, pos, all_logits=True, verify=True, tree=PARENTS)
    eager = RangeExecutor(model, 64)
    eager.run(prompt, 0)
    with torch.inference_mode():
        got = model(tokens, StepInfo.tree(pos, PARENTS, torch.device("cpu")), eager.kv)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    end = pos + len(tokens)
    torch.testing.assert_close(eager.kv.k[:, 0, :end], rowwise.kv.k[:, 0, :end], atol=1e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2, 3], None, None),
    ([], None, None),  # no draft tokens: a plain step
    ([1, 2, 3, 4], None, "4 tokens in a row, not up to 3"),
    ([1, 100], None, "not token ids of the vocabulary"),
    ([1, -1], None, "not token ids of the vocabulary"),
    ([1, True], None, "not token ids of the vocabulary"),
    ("12", None, "not token ids of the vocabulary"),
    ([1, 2, 3, 4], [0, 1, 1, 0], None),
    ([1, 2, 3, 4, 5], [0, 1, 1, 0, 4], "a tree of 5 tokens, not up to 4"),
    ([1, 2, 3, 4], [0, 1, 2, 3], "at most 3 deep"),
    ([1, 2], [0, 3], "parent"),
    ([1, 2], (0, 1), "not a list"),
])
def test_a_proposal_is_checked_against_what_the_step_takes(tokens, parents, match):
    """Up to n=3 tokens in a row or a tree of up to 4 at most 3 deep, of a vocabulary of 100."""
    if match is None:
        check_proposal(tokens, parents, 3, 4, 100)
    else:
        with pytest.raises(ValueError, match=match):
            check_proposal(tokens, parents, 3, 4, 100)
    with pytest.raises(ValueError, match="a tree of"):  # no tree asked for
        check_proposal([1], [0], 3, 0, 100)


@pytest.mark.parametrize("kept", [[4, 5, 6], [1, 3], [1, 2], None],
                         ids=["off-the-first-branch", "a-branch-then-its-sibling", "chain",
                              "root-only"])
def test_hybrid_tree_verify_equals_plain_decode(hybrid_models, kept):
    """A Qwen3.5 model split in two ranges (a recurrent state on each side): each row of a tree
    verify step equals plain decoding of its branch bit for bit, and after keeping any path the
    next step equals plain decoding of that path (the state of its last row is taken)."""
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    models = [load_layer_range(ckpt, a, b) for a, b in ((0, 4), (4, 6))]
    prompt = torch.tensor([5, 9, 13, 2, 7, 11, 3, 8])
    tokens = [4, 6, 12, 6, 10, 14, 1, 15]  # root + 7 draft tokens, rows of PARENTS
    pos = len(prompt)

    def chain(exs, x, at, **kw):
        for ex in exs:
            x = ex.run(x, at, all_logits=True, **kw)
        return x

    def plain(branch):
        exs = [RangeExecutor(m, 64) for m in models]
        chain(exs, prompt, 0)
        return exs, [chain(exs, torch.tensor([tokens[r]]), pos + i)
                     for i, r in enumerate(branch)]

    tree = [RangeExecutor(m, 64) for m in models]
    chain(tree, prompt, 0)
    got = chain(tree, torch.tensor(tokens), pos, verify=True, tree=PARENTS)
    anc = ancestors(PARENTS)
    for row in range(len(tokens)):
        _, outs = plain(anc[row].nonzero().flatten().tolist())
        assert torch.equal(got[row], outs[-1][0]), row
    path = kept or []
    nxt = pos + 1 + len(path)
    for ex in tree:
        ex.before_step(0, nxt, kept)
    exs, _ = plain([0, *path])
    assert torch.equal(chain(tree, torch.tensor([7]), nxt), chain(exs, torch.tensor([7]), nxt))
