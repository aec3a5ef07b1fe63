"""The token tree a block draft proposes: a fixed shape over its per-position top-k.

A DFlash draft predicts every position of its block in one pass, each from the same context, so
it has a ranked list of candidates per position. A tree shape (Medusa's "tree choices", SpecInfer's
token trees) is a list of rank paths: (0,) is the top candidate at the first draft position,
(1,) the second, (0, 2) the third candidate at the second position after the top one at the
first, and so on. The verify step checks every path of the tree in one forward pass
(`shards.spec_tree`), and keeps the longest one the target agrees with.

The shape is chosen offline, from how often the target's token had each rank at each position
(`choose_shape`), and stored in the draft's config.json as `spec_tree`, in priority order: every
prefix of the list is itself a tree (a path comes after its parent), so a runtime that can
afford only N rows takes the first N paths.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layersplit.shards.errors import CheckpointError
from layersplit.shards.spec_tree import is_chain

if TYPE_CHECKING:
    import torch

Shape = tuple[tuple[int, ...], ...]


def read_shape(raw: Any, block_size: int, path: Path) -> Shape | None:
    """The `spec_tree` of a draft's config.json (None when it has none); a malformed one is
    refused naming the file and what is wrong."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise CheckpointError(f"{path}: spec_tree must be a non-empty list of rank paths")
    seen: set[tuple[int, ...]] = {()}
    for i, p in enumerate(raw):
        if not isinstance(p, list) or not 1 <= len(p) < block_size or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise CheckpointError(f"{path}: spec_tree[{i}] = {p!r} is not a list of 1.."
                                  f"{block_size - 1} ranks (integers >= 0)")
        t = tuple(p)
        if t in seen or t[:-1] not in seen:
            raise CheckpointError(f"{path}: spec_tree[{i}] = {p!r} is repeated or comes before "
                                  f"its parent {list(t[:-1])}")
        seen.add(t)
    return tuple(tuple(p) for p in raw)


def instantiate(shape: Shape, top: Sequence[Sequence[int]], nodes: int,
                depth: int) -> tuple[list[int], list[int] | None]:
    """(draft tokens, parents) of the first `nodes` paths of `shape` no deeper than `depth`,
    in depth-first order; `top[d][r]` is the draft's rank-r token at draft position d. Parents
    are None when the tree is a chain."""
    paths = sorted(p for p in shape if len(p) <= depth)  # depth-first: a prefix sorts first
    keep = set([p for p in shape if len(p) <= depth][:nodes])
    paths = [p for p in paths if p in keep]
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents = [], []
    for i, p in enumerate(paths, 1):
        index[p] = i
        parents.append(index[p[:-1]])
        tokens.append(int(top[len(p) - 1][p[-1]]))
    return tokens, None if is_chain(parents) else parents


def width(shape: Shape) -> int:
    """Candidates per position the shape reads (the top-k a proposal needs)."""
    return 1 + max(r for p in shape for r in p)


def choose_shape(ranks: Iterable[torch.Tensor], nodes: int, k: int) -> list[list[int]]:
    """The `nodes` rank paths most often right, in priority order.

    `ranks`: per sequence, (anchors, block - 1) the rank of the target's token among the draft's
    candidates at each draft position (>= k: not among the top k measured). A path's score is the
    fraction of anchors whose ranks start with it; a path never scores above its parent, so the
    best `nodes` paths, parents first on ties, form a tree at every prefix of the list."""
    counts: collections.Counter[tuple[int, ...]] = collections.Counter()
    for r in ranks:
        for row in r.tolist():
            for d in range(1, len(row) + 1):
                if row[d - 1] >= k:
                    break
                counts[tuple(row[:d])] += 1
    order = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    shape: list[tuple[int, ...]] = []
    taken = {()}
    for path, _ in order:
        if len(shape) >= nodes:
            break
        if path[:-1] in taken:
            shape.append(path)
            taken.add(path)
    return [list(p) for p in shape]
