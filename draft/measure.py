"""A draft measured offline on the target's own text: the target's rows for a set of sequences
(`target_rows`: the tapped layers' rows, the draft's context, and the final rows, whose argmax is
the token a greedy verify keeps), the draft's batched forward over blocks of them
(`block_logits`, also its training forward), the rank of the target's token among the draft's
candidates at every draft position (`label_ranks`), and the tokens per verify step a chain or a
token tree would commit (`walk`, `acceptance`). Training (`launch.draft_train`) and choosing a tree
(`launch.draft_tree`) both use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from layersplit.draft.dflash import DFlashDraft, block_mask
from layersplit.shards.hf_convert import hf_causal_lm
from layersplit.shards.layers.rotary import apply_rope, rope_cos_sin
from layersplit.shards.models import LayerRange

TREE_TOP_K = 8  # candidates per draft position a tree shape may use


@dataclasses.dataclass
class Rows:
    """Every sequence's target rows, packed: sequence i is rows offsets[i] .. + lengths[i].
    feats: the tapped layers' rows side by side (the draft's context; HF's
    hidden_states[layer + 1] is the runtime's tap of `layer`); final: the target's normed last
    hidden rows, whose LM-head logits are the distribution the draft learns."""

    tokens: torch.Tensor   # (total,)
    feats: torch.Tensor    # (total, F)
    final: torch.Tensor    # (total, H)
    offsets: torch.Tensor  # (N,)
    lengths: torch.Tensor  # (N,)
    starts: torch.Tensor   # (N,): first generated position

    def __len__(self) -> int:
        return len(self.lengths)

    def index(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        """(b, n) packed row numbers of positions 0..n-1 of sequences idx (past a sequence's
        end: its last row; no real block sees those)."""
        pos = torch.arange(n, device=idx.device)[None].minimum(self.lengths[idx][:, None] - 1)
        return self.offsets[idx][:, None] + pos

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(feats (b, n, F), tokens (b, n), final (b, n, H)) of sequences idx, padded."""
        at = self.index(idx, int(self.lengths[idx].max()))
        return self.feats[at], self.tokens[at], self.final[at]


@torch.inference_mode()
def target_rows(target: LayerRange, seqs: list[list[int]], starts: list[int], taps: list[int],
                device: str, batch: int = 64) -> Rows:
    """Run every sequence through the target once (batched, sorted by length)."""
    cfg = target.cfg
    dtype = next(target.parameters()).dtype
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    offsets = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    hf = hf_causal_lm(target, device, dtype, max((len(s) for s in seqs), default=1))
    feats = torch.empty(total, len(taps) * cfg.hidden_size, dtype=dtype, device=device)
    final = torch.empty(total, cfg.hidden_size, dtype=dtype, device=device)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for b in range(0, len(seqs), batch):
        idx = order[b:b + batch]
        w = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), w, dtype=torch.long)
        for j, i in enumerate(idx):  # right padding: rows of real tokens never see it
            ids[j, :len(seqs[i])] = torch.tensor(seqs[i])
        out = hf.model(ids.to(device), output_hidden_states=True)
        f = torch.cat([out.hidden_states[t + 1] for t in taps], dim=-1)
        for j, i in enumerate(idx):
            o, n = int(offsets[i]), len(seqs[i])
            feats[o:o + n] = f[j, :n]
            final[o:o + n] = out.last_hidden_state[j, :n]
    del hf
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long).to(device)
    return Rows(tokens, feats, final, offsets.to(device), lengths.to(device),
                torch.tensor(starts, dtype=torch.long, device=device))


def greedy_labels(final: torch.Tensor, head: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
    """The target's argmax token after every row of `final` (..., H) -> (...)."""
    flat = final.reshape(-1, final.shape[-1])
    out = torch.cat([(flat[i:i + chunk].float() @ head.float().T).argmax(-1)
                     for i in range(0, len(flat), chunk)] or [flat.new_zeros(0, dtype=torch.long)])
    return out.reshape(final.shape[:-1])


# ---- the training forward (batched; the same math as DFlashDraft.block with context) -----------
def block_logits(draft: DFlashDraft, head: torch.Tensor, embed: torch.Tensor,
                 feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 block: int, mask_id: int) -> torch.Tensor:
    """Logits (b, m, block - 1, V) of the draft tokens of m blocks per sequence.

    feats (b, T, F): context rows; tokens (b, T): the sequences; anchors (b, m): each block's
    first position. Block j sees context rows < anchors[j] and its own rows."""
    b, t_len, _ = feats.shape
    m = anchors.shape[1]
    dev = feats.device
    cfg = draft.cfg.model
    g, d = cfg.num_kv_heads, cfg.head_dim
    pos_q = (anchors[:, :, None] + torch.arange(block, device=dev)).reshape(b, m * block)
    ids = torch.full((b, m, block), mask_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.reshape(b, m * block), embed) * draft.cfg.embedding_scale
    ctx = draft.context(feats)  # (b, T, H)
    pos_c = torch.arange(t_len, device=dev)
    seen_ctx = pos_c[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    blk = torch.arange(m, device=dev).repeat_interleave(block)
    seen_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    masks = {(None, False): torch.cat([seen_ctx, seen_blk], dim=-1)[:, None]}  # (b, 1, mB, T+mB)
    for kind in {draft.cfg.attention(i) for i in range(len(draft.layers))} - set(masks):
        masks[kind] = torch.cat([seen_ctx & block_mask(kind, pos_q, pos_c),
                                 seen_blk & block_mask(kind, pos_q, pos_q)], dim=-1)[:, None]
    cos_q, sin_q = rope_cos_sin(draft.inv_freq, pos_q.reshape(-1), x.dtype)
    for i, layer in enumerate(draft.layers):
        mask = masks[draft.cfg.attention(i)]
        attn = layer.self_attn
        kc, vc = draft.context_kv(ctx.reshape(b * t_len, -1), pos_c.repeat(b), i)
        h = layer.input_layernorm(x).reshape(b * m * block, -1)
        q, k, v = attn.project(h)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_q, sin_q)
        keys = torch.cat([kc.reshape(b, t_len, g, d), k.reshape(b, m * block, g, d)], dim=1)
        vals = torch.cat([vc.reshape(b, t_len, g, d), v.reshape(b, m * block, g, d)], dim=1)
        out = F.scaled_dot_product_attention(
            q.reshape(b, m * block, -1, d).transpose(1, 2), keys.transpose(1, 2),
            vals.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, m * block, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hid = draft.norm(x).reshape(b, m, block, -1)[:, :, 1:]
    return hid @ head.T


def sample_anchors(lengths: torch.Tensor, starts: torch.Tensor, m: int, block: int,
                   gen: torch.Generator) -> torch.Tensor:
    """m anchors per sequence in [max(1, start - 8), length - block)."""
    lo = (starts - 8).clamp_min(1)
    hi = (lengths - block).clamp_min(lo + 1)
    u = torch.rand(len(lengths), m, generator=gen, device=lengths.device)
    return (lo[:, None] + (u * (hi - lo)[:, None]).long()).clamp_max((lengths - block)[:, None])


@torch.no_grad()
def label_ranks(draft: DFlashDraft, head: torch.Tensor, embed: torch.Tensor, rows: Rows,
                labels: torch.Tensor, block: int, mask_id: int, k: int) -> list[torch.Tensor]:
    """Per sequence, (anchors, block - 1): the rank of the target's token (`labels`: its argmax
    after every packed row) among the draft's top k at each draft position of a block at every
    generated position (k: not among them)."""
    out = []
    dev = rows.feats.device
    for i in range(len(rows)):
        lo, hi = int(rows.starts[i]), int(rows.lengths[i]) - block + 1
        if hi <= lo:
            continue
        idx = torch.tensor([i], device=dev)
        feats, tokens, _ = rows.batch(idx)
        a = torch.arange(lo, hi, device=dev)
        logits = block_logits(draft, head, embed, feats, tokens, a[None], block, mask_id)[0]
        lab = labels[rows.index(idx, int(rows.lengths[i]))[0]]
        want = lab[a[:, None] + torch.arange(block - 1, device=dev)]
        hit = logits.topk(k, dim=-1).indices == want[..., None]
        out.append(torch.where(hit.any(-1), hit.int().argmax(-1), k).cpu())
    return out


def walk(ranks: list[torch.Tensor], shape: Sequence[Sequence[int]]) -> float:
    """Tokens per verify step the runtime would commit decoding these continuations with a
    draft of these `label_ranks` proposing the tree `shape` (`draft.tree_shape`; a chain is [[0],
    [0, 0], ...]): a verify at the position after the last committed token keeps the deepest
    path of the tree the ranks follow, plus one."""
    paths = {tuple(p) for p in shape}
    committed, verifies = 0, 0
    for r in ranks:
        rows = r.tolist()
        pos = 0
        while pos < len(rows):
            d = 0
            while d < len(rows[pos]) and tuple(rows[pos][:d + 1]) in paths:
                d += 1
            committed += d + 1
            verifies += 1
            pos += d + 1
    return committed / max(verifies, 1)


def acceptance(draft: DFlashDraft, head: torch.Tensor, embed: torch.Tensor, rows: Rows,
               labels: torch.Tensor, block: int, mask_id: int) -> float:
    """Tokens per verify step of a chain of block - 1 draft tokens (`walk`)."""
    ranks = label_ranks(draft, head, embed, rows, labels, block, mask_id, 1)
    return walk(ranks, [[0] * d for d in range(1, block)])
