"""Token trees of speculative verify steps: their shape, their attention mask, and where the
kept rows go.

A verify step's rows are the nodes of a tree: row 0 is the last committed token (the root), row
j > 0 a draft token whose parent is row `parents[j - 1]` < j. A chain (`parents = [0, 1, 2,
...]`) is the plain block. Rows are in depth-first preorder, so each node's ancestors are the
rows on the path from the root to it, and every subtree is a run of consecutive rows.

Row j sits at position pos + depth(j) (its rotary position) but its K/V are written at row
pos + j of the cache; it attends the committed keys [0, pos) and its own ancestors. After the
step, the kept path (rows n_1 < n_2 < ... < n_k, one per depth) is moved to rows pos + 1 ..
pos + k (`kept_moves`), which every shard and the draft do before the sequence's next step.

A sampled proposal also carries, per row, the distribution q its children were drawn from
(`spec_sampling.pack_q`); `check_q` checks its form (the coordinator, the first and the last
shard run it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

Q_MAX = 32  # tokens of a proposal distribution on the wire: the draft's q is cut to its best 32


def chain(n: int) -> list[int]:
    """The parents of a plain block of n draft tokens."""
    return list(range(n))


def check_tree(parents: Sequence[int], n_draft: int) -> None:
    """Raise ValueError unless `parents` is a preorder tree of `n_draft` draft nodes."""
    if len(parents) != n_draft:
        raise ValueError(f"a tree of {n_draft} draft tokens needs {n_draft} parents, got "
                         f"{len(parents)}")
    stack = [0]  # the path from the root to the previous node
    for j, p in enumerate(parents, 1):
        if not isinstance(p, int) or isinstance(p, bool) or p not in stack:
            raise ValueError(f"tree node {j}: parent {p!r} is not on the path to node {j - 1} "
                             "(parents come before children, subtrees in depth-first order)")
        del stack[stack.index(p) + 1:]
        stack.append(j)


def check_proposal(tokens: object, parents: object, n: int, tree: int, vocab: int) -> None:
    """A draft's proposal for a step that takes up to `n` tokens in a row, or a tree of up to
    `tree` tokens (0: none) at most `n` deep: token ids of the vocabulary and, with `parents`, a
    well-formed tree. ValueError naming what is wrong."""
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise ValueError(f"{str(tokens)[:80]}: not token ids of the vocabulary (0..{vocab - 1})")
    if parents is None:
        if len(tokens) > n:
            raise ValueError(f"{len(tokens)} tokens in a row, not up to {n}")
        return
    if not isinstance(parents, list):
        raise ValueError(f"parents {str(parents)[:80]}: not a list")
    check_tree(parents, len(tokens))
    if not tree or len(tokens) > tree or max(depths(parents), default=0) > n:
        raise ValueError(f"a tree of {len(tokens)} tokens, not up to {tree} at most {n} deep")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every row (the root's is 0)."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def ancestors(parents: Sequence[int]) -> torch.Tensor:
    """(n, n) bool: [i, j] when row j is row i or one of its ancestors."""
    import torch
    n = len(parents) + 1
    anc = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents, 1):
        anc[j] |= anc[p]
    return anc


def is_chain(parents: Sequence[int] | None) -> bool:
    return parents is None or all(p == j for j, p in enumerate(parents))


def rows_to_move(path: Sequence[int] | None) -> list[int] | None:
    """The kept rows of a verify step when some of them must move (`kept`), else None: a path
    of rows 1 .. k (a chain's, or a tree's first branch) is where its positions are already."""
    if not path or list(path) == list(range(1, len(path) + 1)):
        return None
    return list(path)


def check_path(path: Sequence[int], pos: int) -> None:
    """Raise ValueError unless `path` can be the kept rows of the verify step that preceded a
    step at `pos`: k rows, increasing, row d at or after depth d, ending at pos - 1."""
    k = len(path)
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in path) or any(
            j < d for d, j in enumerate(path, 1)) or any(
            b <= a for a, b in itertools.pairwise(path)) or pos - k - 1 < 0:
        raise ValueError(f"kept tree rows {list(path)[:40]} before position {pos}: not an "
                         "increasing path of rows after the root")


def kept_moves(pos: int, path: Sequence[int]) -> tuple[list[int], list[int]]:
    """(source rows, destination rows) that bring the kept path of the verify step before a
    step at `pos` (rows n_1 .. n_k of a verify step at pos - k - 1) to the rows that step's
    positions take, pos - k .. pos - 1. Moves in that order never read a row an earlier move
    wrote (n_d >= d, increasing)."""
    base = pos - len(path) - 1
    src, dst = [], []
    for d, j in enumerate(path, 1):
        if j != d:
            src.append(base + j)
            dst.append(base + d)
    return src, dst


def sampled_children(parents: Sequence[int], n_rows: int) -> list[list[int]]:
    """Per row, its children's rows in row order."""
    kids: list[list[int]] = [[] for _ in range(n_rows)]
    for j, p in enumerate(parents, 1):
        kids[p].append(j)
    return kids


def check_q_form(q: object, n: int) -> None:
    """ValueError unless `q` has the form of a proposal of `n` draft tokens: n + 1 entries, each
    None or up to Q_MAX packed pairs. The cheap part of `check_q`, which every shard runs (the
    last shard, which reads q, runs the whole check)."""
    if not isinstance(q, list) or len(q) != n + 1:
        raise ValueError(f"q must be a list of {n + 1} entries (one per row), got "
                         f"{str(q)[:60]}")
    for row, entry in enumerate(q):
        if entry is not None and (not isinstance(entry, bytes) or not entry or len(entry) % 8
                                  or len(entry) // 8 > Q_MAX):
            raise ValueError(f"q[{row}]: not up to {Q_MAX} packed (id, probability) pairs")


def check_q(q: object, tokens: Sequence[int], parents: Sequence[int] | None, vocab: int) -> None:
    """ValueError unless `q` fits a proposal: one entry per row (n + 1), None for a row whose
    children are all point masses (or that has none), else a packed distribution (`pack_q`) of
    at most Q_MAX tokens of the vocabulary, probabilities >= 0 summing to about 1, whose first
    min(children, support) children carry distinct tokens of its support."""
    n = len(tokens)
    check_q_form(q, n)
    kids = sampled_children(parents if parents is not None else range(n), n + 1)
    for row, entry in enumerate(q):
        if entry is None:
            continue
        m = len(entry) // 8  # (`spec_sampling.pack_q`: int32 ids, then float32 probabilities)
        probs = np.frombuffer(entry, dtype=np.float32, count=m, offset=4 * m)
        id_list = np.frombuffer(entry, dtype=np.int32, count=m).tolist()
        p_list = probs.tolist()
        if min(id_list) < 0 or max(id_list) >= vocab or len(set(id_list)) != len(id_list):
            raise ValueError(f"q[{row}]: token ids not distinct ids of the vocabulary")
        if not all(math.isfinite(p) and p >= 0 for p in p_list) or \
                abs(float(probs.sum()) - 1) > 1e-3:
            raise ValueError(f"q[{row}]: probabilities not >= 0 summing to 1")
        if not kids[row]:
            raise ValueError(f"q[{row}]: row {row} has no children")
        support = {i: p for i, p in zip(id_list, p_list) if p > 0}
        drawn = [tokens[j - 1] for j in kids[row][:len(support)]]
        if len(set(drawn)) != len(drawn) or not all(t in support for t in drawn):
            raise ValueError(f"q[{row}]: the children drawn from it are not distinct tokens "
                             "of its support")
