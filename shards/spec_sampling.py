"""Sampled proposals: a draft that draws its tokens from its own distribution q.

Two ways (`spec_sampling`, docs/speculative.md): *coupled* draws (`coupled_draws`) order q by
the target's own noise of each position, so the verifier's match rule (`accept_draft` without
q) keeps plain decoding's very tokens; *rejection* (below) sends q and verifies by rejection
sampling.

With sampling (temperature > 0), a draft may *sample* its proposal from a distribution q and
send q with it; the verifier then keeps a draft token x with probability min(1, p(x)/q(x)),
where p is the target's distribution at that row (after temperature, top-k, top-p), instead of
only when x equals the target's own draw. For a chain this keeps, per position, sum_x min(p, q)
= 1 - TV(p, q) of the mass, against p(d) for a fixed guess d.

At a tree node the children are tried in row order (recursive rejection sampling without
replacement, Jeon et al. 2024, "Recursive Speculative Decoding"): the first `m` children were
drawn one after the other *without replacement* from the node's q (`m` = the children, or
q's support when smaller); child i, drawn from q_i (q without the i - 1 tokens before it,
renormalized), is kept with probability min(1, p_i(x_i)/q_i(x_i)); on rejection
p_{i+1} = norm(max(0, p_i - q_i)). Each try is one rejection-sampling step for target p_i and
proposal q_i, whose leftover is exactly p_{i+1}, so by induction the node's token has
distribution p_1 = p. Children after the first m (the draft's fixed runner-ups, where q ran out
of tokens) are point masses: the node draws one token from the last residual, and a child
carrying it is kept (a point mass δ_y is kept with probability p'(y), and the draw from the
residual given "not y" is the next residual's draw). If no child is kept, that draw is the
node's token.

Randomness is stateless like plain sampling (`shards.sampling`): the final draw at position P
uses plain decoding's noise for P (so a node with no children draws exactly plain's token), the
acceptance coins at P a stream of their own, and the draft's samples for a proposal at `pos`
another stream per `pos`. Each is consumed by at most one decision, so the same seed gives the
same tokens, and the output has the target's distribution (not plain decoding's very tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from layersplit.shards.sampling import (
    counter_uniform,
    exponential_noise,
    filtered_probs,
    mix_seed,
    pack_bias,
    unpack_bias,
    vocab_noise,
)
from layersplit.shards.spec_tree import Q_MAX, sampled_children

COIN_STREAM = 1  # the acceptance coins at a position
DRAFT_STREAM = 2  # + the proposal's position: the draft's samples


def proposal_q(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               limit: int = Q_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a draft samples from at each of its rows (n, V) of logits: the
    request's temperature, top-k and top-p applied to the draft's logits, cut to the best
    `limit` tokens, renormalized. Returns (ids (n, limit) int64, probs (n, limit) float32);
    tokens outside the support have probability 0 (they are never drawn)."""
    probs = filtered_probs(logits, temperature, top_k, top_p)
    p, ids = probs.topk(min(limit, probs.shape[-1]), dim=-1)
    return ids, p / p.sum(-1, keepdim=True)


def draw_without_replacement(ids: torch.Tensor, probs: torch.Tensor, k: int, seed: int,
                             position: int, pos: int) -> list[int]:
    """Up to `k` distinct tokens drawn one after the other without replacement from the
    distribution (ids, probs) (its support bounds how many): the Gumbel-top-k trick, the
    exponential noise seeded by (seed, position, the proposal's `pos`)."""
    noise = exponential_noise([mix_seed(seed, position, DRAFT_STREAM + pos)],
                              torch.arange(probs.shape[-1], device=probs.device)[None])[0]
    return _first_by_noise(ids, probs, noise, k)


def _first_by_noise(ids: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor,
                    k: int) -> list[int]:
    """The (up to) k ids of largest probs / noise, within the support of probs."""
    support = int((probs > 0).sum())
    order = torch.argsort(probs / noise, descending=True)[:min(k, support)]
    return ids[order].tolist()


def pack_q(ids: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor) -> bytes:
    """One node's q on the wire: int32 ids, then their float32 probabilities."""
    if isinstance(ids, torch.Tensor):
        ids, probs = ids.tolist(), probs.tolist()
    return pack_bias(ids, probs)


def unpack_q(b: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    return unpack_bias(b)


def accept_sampled(
    logits: torch.Tensor,  # (n, V): rows of the step [last token, d_1, ..., d_{n-1}]
    draft: Sequence[int],
    q: Sequence[bytes | None],  # per row: the distribution its first children were drawn from
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    pos: int,
    parents: Sequence[int] | None = None,
) -> tuple[list[int], int]:
    """The rows kept and the token after them, by recursive rejection sampling (module doc).
    `q` must have passed `check_q`."""
    n = logits.shape[0]
    if len(draft) != n - 1 or len(q) != n:
        raise ValueError(f"{n} rows verify {n - 1} draft tokens with {n} q entries, got "
                         f"{len(draft)} and {len(q)}")
    kids = sampled_children(parents if parents is not None else range(n - 1), n)
    path: list[int] = []
    row = 0
    while True:
        position = pos + len(path) + 1  # the position of the token this row decides
        p = filtered_probs(logits[row:row + 1], temperature, top_k, top_p)[0]
        children = kids[row]
        nxt = None
        if q[row] is not None and children:
            ids, probs = unpack_q(q[row])
            ids, qd = ids.to(p.device), probs.to(p.device, torch.float32)
            qd = qd / qd.sum()
            m = min(len(children), int((qd > 0).sum()))
            coins = counter_uniform([mix_seed(seed, position, COIN_STREAM)],
                                    torch.arange(m)[None])[0].tolist()
            for j, u in zip(children[:m], coins):
                x = draft[j - 1]
                qfull = torch.zeros_like(p).index_put_((ids,), qd)
                if u * float(qfull[x]) < float(p[x]):  # kept with probability min(1, p/q)
                    nxt = j
                    break
                resid = (p - qfull).clamp_min(0)
                total = resid.sum()
                # (a residual of 0 would mean p == q, where nothing is ever rejected)
                p = resid / total if total > 0 else p
                qd = qd.masked_fill(ids == x, 0.0)  # the next child: q without x
                if qd.sum() <= 0:
                    break
                qd = qd / qd.sum()
            children = children[m:]  # the rest are point masses
        if nxt is None:
            noise = vocab_noise([mix_seed(seed, position)], p.shape[-1], p.device)[0]
            tok = int(torch.argmax(p / noise))
            nxt = next((j for j in children if draft[j - 1] == tok), None)
            if nxt is None:
                return path, tok
        path.append(nxt)
        row = nxt


def coupled_draws(ids: torch.Tensor, probs: torch.Tensor, k: int, seed: int,
                  position: int) -> list[int]:
    """Up to `k` tokens of (ids, probs) in the order of probs / E, E the exponential noise
    plain decoding draws the target's token at `position` with (`shards.sampling.sample_rows`:
    its token is argmax p / E). The first is the draft's draw coupled with the target's: where
    q = p they are the same token; the others follow without replacement."""
    noise = exponential_noise([mix_seed(seed, position)], ids[None])[0]
    return _first_by_noise(ids, probs, noise, k)


def _draws(ids: torch.Tensor, probs: torch.Tensor, fixed: Sequence[Sequence[int]] | torch.Tensor,
           m: int, k: int, seed: int, pos: int, coupled: int
           ) -> tuple[list[list[int]], list[list[int]], list[bytes | None]]:
    """For each of the first `m` draft depths: its first (up to) k draws without replacement
    (`coupled_draws`, or `draw_without_replacement` when `coupled` is 0, with their very
    noise), its fixed candidates, and (not coupled) its q entry; one read of the device for
    them all."""
    if not m:
        return [], [], []
    depths = range(m)
    dev = probs.device
    row_ids, row_p = ids[:m], probs[:m]  # (slices: nothing to copy to the device first)
    if coupled:  # the target's noise at the draft's tokens
        noise = exponential_noise([mix_seed(seed, pos + d + 1) for d in depths], row_ids)
    else:
        noise = exponential_noise(
            [mix_seed(seed, pos + d + 1, DRAFT_STREAM + pos) for d in depths],
            torch.arange(row_p.shape[-1], device=dev).expand(m, -1))
    order = torch.argsort(row_p / noise, dim=-1, descending=True)[:, :k]
    k = order.shape[1]  # (at most the distribution's length)
    parts = [row_ids.gather(1, order), (row_p > 0).sum(-1, keepdim=True)]
    if isinstance(fixed, torch.Tensor):
        parts.append(fixed[:m].to(dev, parts[0].dtype))
    host = torch.cat(parts, 1).tolist()  # (the one wait for the device)
    drawn = [row[:min(k, row[k])] for row in host]
    fixed_rows = [row[k + 1:] for row in host] if isinstance(fixed, torch.Tensor) else \
        [list(fixed[d]) for d in depths]
    qs: list[bytes | None] = [None] * m
    if not coupled:
        cpu_ids, cpu_p = row_ids.cpu(), row_p.cpu()
        for i in depths:
            keep = cpu_p[i] > 0
            qs[i] = pack_q(cpu_ids[i][keep], cpu_p[i][keep])
    return drawn, fixed_rows, qs


def sample_tree(parents: Sequence[int] | None, n: int, ids: torch.Tensor, probs: torch.Tensor,
                fixed: Sequence[Sequence[int]] | torch.Tensor, seed: int, pos: int,
                coupled: int = 0) -> tuple[list[int], list[bytes | None]]:
    """A sampled proposal of `n` draft tokens in the tree `parents` (None: a chain) after the
    token at `pos`: (tokens, q). `ids`, `probs` (depth, k): the draft's distribution at each
    draft position (`proposal_q`); `fixed[d]`: its ranked candidates there, which fill the
    children past q's support. The children of every node at depth d take, in row order, the
    draws without replacement at draft position d, then the fixed candidates not drawn; the
    node's q entry is that distribution.

    `coupled` (nonzero: on; the draft passes its vocabulary size): draw with the target's own
    noise instead (`coupled_draws`) and send no q: the verifier then keeps a child when it
    carries the target's draw, so the output is plain decoding's very tokens, and the draft's
    draws match the target's as often as q is near p.

    Every depth's draws are computed at once and read from the device in one copy (`fixed`
    may be a tensor, read in the same copy): the tokens of `coupled_draws` and
    `draw_without_replacement` at each depth, without a wait for the device per depth."""
    par = list(parents) if parents is not None else list(range(n))
    kids = sampled_children(par, n + 1)
    depth = [0]
    for p in par:
        depth.append(depth[p] + 1)
    need: dict[int, int] = {}
    for row, ch in enumerate(kids):
        if ch:
            need[depth[row]] = max(need.get(depth[row], 0), len(ch))
    tokens: list[int] = [0] * n
    q: list[bytes | None] = [None] * (n + 1)
    cands: dict[int, tuple[list[int], bytes | None]] = {}
    # (the depths with children are 0 .. len(need) - 1: a node's parent has a child, it)
    drawn, fixed_rows, qs = _draws(ids, probs, fixed, len(need), max(need.values(), default=0),
                                   seed, pos, coupled)
    for d, (got, fx, qd) in enumerate(zip(drawn, fixed_rows, qs)):
        got = got[:need[d]]
        cands[d] = (got + [int(t) for t in fx if int(t) not in got], qd)
    for row, ch in enumerate(kids):
        if ch:
            order, q[row] = cands[depth[row]]
            if len(order) < len(ch):
                raise ValueError(f"{len(ch)} children at depth {depth[row] + 1}, only "
                                 f"{len(order)} candidates")
            for i, j in enumerate(ch):
                tokens[j - 1] = order[i]
    return tokens, q if not coupled else None
