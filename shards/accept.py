"""Verifying draft tokens on the last shard: the rows of a verify step kept, and the token
that follows them. Point-mass proposals (a draft's best guesses) are checked against the
target's own draws (`shards.sampling`); sampled proposals that carry their distributions, by
rejection sampling (`shards.spec_sampling`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from layersplit.shards.sampling import is_greedy, sample_rows
from layersplit.shards.spec_sampling import accept_sampled


def accept_draft(
    logits: torch.Tensor,  # (n, V): rows of the step [last token, d_1, ..., d_{n-1}]
    draft: Sequence[int],  # d_1 .. d_{n-1}
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    pos: int,  # position of the step's first row
    parents: Sequence[int] | None = None,  # a token tree (`shards.spec_tree`); None: a chain
    q: Sequence[bytes | None] | None = None,  # a sampled proposal's distributions, per row
) -> tuple[list[int], int]:
    """Verify draft tokens: (the rows kept, the token that follows the last kept one).

    With `q` (a draft that sampled its proposal and sent the distributions it drew from) and
    sampling, by speculative rejection sampling (`shards.spec_sampling.accept_sampled`). Else:

    The walk starts at row 0. At a row of depth d, the target's token for position pos + d + 1
    is drawn exactly as plain decoding draws it (greedy: the argmax; sampling: the seeded draw
    of that position); if a child of the row carries that token, the walk moves to it, else the
    drawn token is emitted and the walk ends. For a chain this keeps the longest run of draft
    tokens equal to the target's and then the bonus token.

    For a chain this is rejection sampling for a draft that proposes one token per position (a
    point mass q = δ_d): d is accepted with probability p(d) = min(1, p(d)/q(d)), and a rejected
    position emits a draw from p restricted to tokens other than d, which is the residual
    (p - q)+ renormalized; a tree tries several point masses at once and keeps the one the draw
    names. So the output distribution is exactly the target's; more than that, each emitted
    token is the one plain decoding with the same seed emits, so speculative output equals
    plain output token for token, greedy or sampled.
    """
    n = logits.shape[0]
    if len(draft) != n - 1:
        raise ValueError(f"{n} rows verify {n - 1} draft tokens, got {len(draft)}")
    if q is not None and not is_greedy(temperature, top_k):
        return accept_sampled(logits, draft, q, temperature, top_k, top_p, seed, pos, parents)
    if parents is None:
        parents = range(n - 1)
    children: list[dict[int, int]] = [{} for _ in range(n)]
    for j, (p, t) in enumerate(zip(parents, draft), 1):
        children[p].setdefault(t, j)
    # Greedy: every row's argmax at once, one wait for the device. Sampled: the rows the walk
    # visits, each alone, as plain decoding draws a sequence's token (softmax and top-p's sums
    # over several rows at once may round otherwise: a different token)
    greedy = is_greedy(temperature, top_k)
    toks = logits.argmax(dim=-1).tolist() if greedy else None
    path: list[int] = []
    row = 0
    while True:
        tok = toks[row] if greedy else sample_rows(
            logits[row:row + 1], temperature, top_k, top_p, seed, [pos + len(path) + 1])[0]
        nxt = children[row].get(tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        row = nxt
