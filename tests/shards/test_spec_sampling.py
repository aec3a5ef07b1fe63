"""Speculative rejection sampling with sampled proposals (`shards.spec_sampling`): generating
with verify steps over chains and trees gives exactly the target's distribution (chi-square on
the joint distribution of two tokens, fixed seeds); the test notices a verifier that is told
a wrong q; malformed q is refused by name; the same seed gives the same tokens."""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch
from layersplit.shards.accept import accept_draft
from layersplit.shards.sampling import filtered_probs, sample_rows
from layersplit.shards.spec_sampling import (
    coupled_draws,
    draw_without_replacement,
    pack_q,
    proposal_q,
    sample_tree,
    sampled_children,
    unpack_q,
)
from layersplit.shards.spec_tree import check_q

V = 4  # vocabulary of the harness
L = 2  # tokens generated per trial: their joint distribution is tested
TRIALS = 1000
P_MIN = 1e-4  # deterministic (fixed seeds), yet a wrong rule fails far below it


@functools.cache
def _logits(prefix: tuple[int, ...], salt: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(bytes([salt, *prefix])))
    return torch.randn(V, generator=g) * scale


@functools.cache
def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target: its next-token logits depend on the whole prefix."""
    return _logits(prefix, 0, 1.5)


@functools.cache
def draft_logits(prefix: tuple[int, ...], d: int) -> torch.Tensor:
    """A toy DFlash-like draft: position pos + d + 1 from the committed prefix only (it does
    not see its own earlier draft tokens), near the target at d = 0, farther after."""
    return target_logits(prefix) * (1.0 if d == 0 else 0.3) + _logits(prefix, d + 1, 2.0)


def _generate(seed: int, parents: list[int] | None, n: int, temperature: float, top_k: int,
              top_p: float, wrong_q: bool = False) -> tuple[int, ...]:
    """L tokens after token 0, by verify steps of the proposal tree `parents` (n draft tokens),
    each proposal sampled by the real draft-side code and verified by the real verifier."""
    prefix: tuple[int, ...] = (0,)
    pos = 0
    while len(prefix) - 1 < L:
        dl = torch.stack([draft_logits(prefix, d) for d in range(n)])
        ids, probs = proposal_q(dl, temperature, top_k, top_p)
        fixed = dl.topk(V, dim=-1).indices.tolist()
        tokens, q = sample_tree(parents, n, ids, probs, fixed, seed, pos)
        check_q(q, tokens, parents, V)
        if wrong_q:  # tell the verifier the draft sampled uniformly over q's support
            q = [None if e is None else pack_q(unpack_q(e)[0], torch.full(
                (len(e) // 8,), 8.0 / len(e))) for e in q]
        par = parents if parents is not None else list(range(n))
        row_prefix = [prefix]
        for j, p in enumerate(par, 1):
            row_prefix.append(row_prefix[p] + (tokens[j - 1],))
        logits = torch.stack([target_logits(r) for r in row_prefix])
        path, tok = accept_draft(logits, tokens, temperature, top_k, top_p, seed, pos,
                                 parents, q)
        prefix = prefix + tuple(tokens[j - 1] for j in path) + (tok,)
        pos += len(path) + 1
    return prefix[1:L + 1]


def _target_joint(temperature: float, top_k: int, top_p: float) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob, prefix = 1.0, (0,)
        for t in seq:
            prob *= float(filtered_probs(target_logits(prefix)[None], temperature, top_k,
                                         top_p)[0, t])
            prefix += (t,)
        out[seq] = prob
    return out


def _p_value(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float]) -> float:
    n = sum(counts.values())
    assert all(counts.get(s, 0) == 0 for s, p in joint.items() if p == 0), "an impossible seq"
    cells = [(counts.get(s, 0), n * p) for s, p in joint.items() if p > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


SHAPES = {  # name: (parents, draft tokens, temperature, top_k, top_p)
    "chain": (None, 3, 0.7, 0, 0.9),
    "two-branch": ([0, 1, 0, 3], 4, 1.0, 0, 1.0),
    # three candidates for the first position but top-k 2: q's support holds two, the third
    # is the draft's fixed runner-up (a point mass); a deeper first branch
    "deep": ([0, 1, 2, 1, 0, 5, 0], 7, 0.8, 2, 1.0),
}


def _counts(shape: str, trials: int, wrong_q: bool = False) -> tuple[dict, dict]:
    parents, n, t, k, p = SHAPES[shape]
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(trials):
        s = _generate(seed, parents, n, t, k, p, wrong_q)
        counts[s] = counts.get(s, 0) + 1
    return counts, _target_joint(t, k, p)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sampled_proposals_keep_the_target_distribution(shape):
    counts, joint = _counts(shape, TRIALS)
    assert _p_value(counts, joint) > P_MIN, (counts, joint)


def test_the_harness_notices_a_wrong_q():
    """The same harness with the verifier told a wrong q (uniform over what the draft could
    draw): the output is not the target's distribution, and the test says so."""
    counts, joint = _counts("two-branch", TRIALS, wrong_q=True)
    assert _p_value(counts, joint) < P_MIN


def test_sampled_proposals_keep_more_than_point_masses():
    """With the draft's q the chain keeps more draft tokens than with the draft's argmax
    (a point mass per position, verified by matching the target's draw)."""
    t, p = 1.0, 1.0
    kept_q = kept_argmax = 0
    for seed in range(300):
        prefix = (0,)
        dl = torch.stack([draft_logits(prefix, d) for d in range(3)])
        ids, probs = proposal_q(dl, t, 0, p)
        tokens, q = sample_tree(None, 3, ids, probs, dl.topk(V).indices.tolist(), seed, 0)
        greedy = dl.argmax(-1).tolist()
        for toks, qq in ((tokens, q), (greedy, None)):
            rows = [prefix]
            for x in toks:
                rows.append(rows[-1] + (x,))
            logits = torch.stack([target_logits(r) for r in rows])
            path, _ = accept_draft(logits, toks, t, 0, p, seed, 0, None, qq)
            if qq is None:
                kept_argmax += len(path)
            else:
                kept_q += len(path)
    assert kept_q > kept_argmax


def test_same_seed_same_tokens():
    a = [_generate(s, [0, 1, 0, 3], 4, 0.9, 0, 0.95) for s in range(20)]
    assert a == [_generate(s, [0, 1, 0, 3], 4, 0.9, 0, 0.95) for s in range(20)]
    assert len(set(a)) > 1


def test_malformed_q_is_refused_by_name():
    tokens, parents = [1, 2, 3], [0, 0, 1]
    good = pack_q([1, 2, 0], [0.5, 0.25, 0.25])
    check_q([good, None, None, None], tokens, parents, V)
    cases = {
        "one per row": [good, None],
        "no children": [None, None, good, None],
        "summing to 1": [pack_q([1, 2], [0.5, 0.2]), None, None, None],
        "not >= 0": [pack_q([1, 2], [1.5, -0.5]), None, None, None],
        "not >= 0 summing": [pack_q([1, 2], [float("nan"), 1.0]), None, None, None],
        "vocabulary": [pack_q([1, 9], [0.5, 0.5]), None, None, None],
        "not distinct": [pack_q([1, 1], [0.5, 0.5]), None, None, None],
        "support": [pack_q([1, 0], [0.5, 0.5]), None, None, None],  # child token 2 not in q
        "packed": [b"\x00" * 5, None, None, None],
    }
    for why, q in cases.items():
        with pytest.raises(ValueError, match=why):
            check_q(q, tokens, parents, V)


def test_coupled_draws_of_a_perfect_draft_are_all_kept():
    """Coupled draws (`spec_sampling = coupled`) use the target's own noise: a draft whose q is
    the target's p proposes exactly plain sampling's tokens, so every one is kept, and the
    verifier (no q: the draw must match) emits plain's tokens."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    for seed in range(30):
        ids, probs = proposal_q(logits[:3], 0.8, 0, 0.95, limit=50)
        fixed = logits[:3].topk(2, dim=-1).indices.tolist()
        tokens, q = sample_tree(None, 3, ids, probs, fixed, seed, 10, coupled=50)
        assert q is None
        plain = sample_rows(logits, 0.8, 0, 0.95, seed, [11, 12, 13, 14])
        assert tokens == plain[:3]  # (the rows' logits do not depend on the tokens here)
        assert accept_draft(logits, tokens, 0.8, 0, 0.95, seed, 10) == ([1, 2, 3], plain[3])


@pytest.mark.parametrize("coupled", [False, True])
def test_all_depths_drawn_at_once_equal_each_depth_drawn_alone(coupled):
    """`sample_tree` reads every depth's draws from the device in one copy; its tokens and q are
    those of drawing each depth on its own (`coupled_draws`, `draw_without_replacement`), for
    chains and trees, supports smaller and larger than the children, `fixed` as a list or a
    tensor."""
    g = torch.Generator().manual_seed(7)
    shapes = [None, [0, 0, 1, 1, 2, 0], [0, 1, 2, 3], [0, 0, 0, 0, 1, 1]]
    for trial in range(40):
        vocab = (50, 400)[trial % 2]
        parents = shapes[trial % len(shapes)]
        n = 4 if parents is None else len(parents)
        logits = torch.randn(n, vocab, generator=g) * (0.5 + trial % 5)
        ids, probs = proposal_q(logits, 0.7, (0, 3, 20)[trial % 3], (1.0, 0.9)[trial % 2],
                                limit=(4, 32)[trial % 2])
        top = logits.topk(6, dim=-1).indices
        seed, pos = 1000 + trial, 17 + trial
        got = [sample_tree(parents, n, ids, probs, fixed, seed, pos, vocab if coupled else 0)
               for fixed in (top.tolist(), top)]
        assert got[0] == got[1]
        # each depth alone
        par = list(parents) if parents is not None else list(range(n))
        kids, depth = sampled_children(par, n + 1), [0]
        for p in par:
            depth.append(depth[p] + 1)
        tokens, q = [0] * n, [None] * (n + 1)
        for row, ch in enumerate(kids):
            if not ch:
                continue
            d = depth[row]
            k = max(len(c) for r, c in enumerate(kids) if c and depth[r] == d)
            drawn = coupled_draws(ids[d], probs[d], k, seed, pos + d + 1) if coupled \
                else draw_without_replacement(ids[d], probs[d], k, seed, pos + d + 1, pos)
            order = drawn + [t for t in top[d].tolist() if t not in drawn]
            for i, j in enumerate(ch):
                tokens[j - 1] = order[i]
            if not coupled:
                keep = probs[d] > 0
                q[row] = pack_q(ids[d][keep], probs[d][keep])
        assert got[0] == (tokens, None if coupled else q), trial
