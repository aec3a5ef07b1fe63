"""Proposers: what the draft process runs. One small interface, two kinds.

- `DFlashProposer`: a feature-conditioned block draft (`draft.dflash`). The target's tapped rows
  arrive by position (`write_features`) into a position-indexed store; a proposal projects the
  committed rows it has not seen yet into the draft's KV cache, then drafts a whole block in one
  forward pass. Rows of rejected positions are simply overwritten later: only rows below the
  position of the proposal's last token are ever read.
- `ClassicProposer`: any smaller model with the target's tokenizer, drafting autoregressively
  with its own KV cache.

A proposal is the draft's best guesses (argmax, or top-k in a tree: `shards.accept.accept_draft`
keeps one when it equals the target's own draw, so sampled output is plain decoding's), or, for
a DFlash draft whose sequence samples (`begin`'s `sample`), draws from its own distribution sent
along (`q`: `shards.spec_sampling`, rejection sampling). A classic draft always guesses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from layersplit.draft.dflash import (
    DFlashDraft,
    block_step,
    draft_step,
    draft_step_batch,
    layer_weights,
    load_dflash,
)
from layersplit.draft.dflash_config import DFlashConfig, dflash_folder, read_dflash_config
from layersplit.draft.tree_shape import instantiate, width
from layersplit.shards.checkpoint import (
    RANDOM_PREFIX,
    Checkpoint,
    load_layer_range,
    open_checkpoint,
)
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.device import to_device
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.graphs import BATCH_BUCKETS, batch_bucket, capture, keep_recent
from layersplit.shards.kv_cache import KVCache, KVLayout
from layersplit.shards.spec_sampling import proposal_q, sample_tree
from layersplit.shards.spec_tree import kept_moves
from layersplit.shards.weights import source_name

log = logging.getLogger(__name__)
CLASSIC_BLOCK = 5  # a classic draft proposes 4 tokens per verify unless told otherwise
# batched proposals' graphs hold their logits while kept: past this many bytes of them, the
# least recently replayed goes (captured again when needed)
BATCH_GRAPH_BYTES = 256 << 20
CLASSIC_CHUNK = 256


class Proposer(Protocol):
    """One draft context per slot (the slots of the target's KV cache: one per sequence)."""

    kind: str  # "dflash" | "classic"
    block_size: int  # rows of a verify step: the last token and block_size - 1 draft tokens
    slots: int

    def set_slots(self, slots: int) -> None:
        """Hold `slots` sequences' contexts (all forgotten)."""

    def begin(self, slot: int, sample: dict | None = None) -> None:
        """A new sequence starts in `slot`: forget the last one's context. `sample`: its
        sampling ({temperature, top_k, top_p, seed}) when its proposals are to be sampled."""

    def propose(self, slot: int, token: int, pos: int, n: int, tokens: torch.Tensor | None,
                start: int, tree: int = 0, kept: list[int] | None = None
                ) -> tuple[list[int], list[int] | None, list | None]:
        """Draft tokens for positions pos+1 .. pos+n, after `token` at position pos, their
        parents (`shards.spec_tree`; None: a chain of n) and the distributions they were drawn
        from (`shards.spec_sampling`; None: best guesses). `tokens`: committed tokens at
        [start, pos) the proposer has not seen (classic); `tree`: at most this many tokens as a
        tree, where the draft has a tree shape (0: a chain); `kept`: the tree rows the last
        verify step kept (their feature rows move into place first)."""


class DFlashProposer:
    kind = "dflash"

    def __init__(self, draft: DFlashDraft, embed: torch.Tensor, head: torch.Tensor,
                 max_len: int, device: torch.device, graphs: bool, bucket: int = 256,
                 compile: bool = True) -> None:
        cfg: DFlashConfig = draft.cfg
        self.draft, self.cfg = draft, cfg
        self.embed, self.head = embed, head
        self.block_size = cfg.block_size
        self.device = device
        self.context_len = max_len
        self.bucket = bucket
        self.set_slots(1)
        self.static = graphs  # the fixed-shape step (captured on CUDA; run as is elsewhere)
        self.capture = graphs and device.type == "cuda"
        self._done_t = torch.zeros(1, dtype=torch.long, device=device)
        self._pos_t = torch.zeros(1, dtype=torch.long, device=device)
        self._ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long,
                               device=device)  # the block: [last token, mask, ...]
        self._rows = torch.arange(cfg.block_size, device=device)
        self._kv_weights = draft.kv_weights()
        self._layers = [layer_weights(x) for x in draft.layers]
        self._kinds = tuple(cfg.attention(i) for i in range(cfg.model.num_layers)) \
            if cfg.windows else ()
        self._use_compiled(self.capture and compile)

    def set_slots(self, slots: int) -> None:
        dtype, m = self.embed.dtype, self.cfg.model
        self.slots = slots
        self.features = torch.zeros(1, slots, self.context_len, self.cfg.width, dtype=dtype,
                                    device=self.device)
        layout = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, dtype)
        self.kv = KVCache(layout, self.context_len + self.cfg.block_size, slots, self.device)
        self.done = [0] * slots  # per slot: context rows [0, done) are in the KV cache
        # per slot and position: whether a proposal may read the context row there (False:
        # rows that never came, `gap`); `holes`: whether the slot has any
        self.known = torch.ones(slots, self.kv.max_len, dtype=torch.bool, device=self.device)
        self.holes = [False] * slots
        self.sampling: list[dict | None] = [None] * slots  # per slot: sample its proposals
        self._forget_graphs()

    def _forget_graphs(self) -> None:
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        # batched proposals (`propose_batch`): padded count -> (slots, done, pos (Sp,), ids
        # (Sp, block)) static buffers; (padded count, kv_len) -> graph, outputs
        self.batch_inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.batch_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        # a new memory pool: one whose graphs are all freed may not be captured into again
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    @property
    def top_k(self) -> int:
        """Candidates per draft position a proposal reads: its tree's width, 1 for chains."""
        shape = self.cfg.spec_tree
        return min(width(shape), self.cfg.model.vocab_size) if shape else 1

    @property
    def max_len(self) -> int:
        return self.features.shape[2]

    def begin(self, slot: int, sample: dict | None = None) -> None:
        self.done[slot] = 0
        self.sampling[slot] = sample
        if self.holes[slot]:
            self.known[slot].fill_(True)
            self.holes[slot] = False

    def gap(self, slot: int, start: int, end: int) -> None:
        """The context rows [start, end) of `slot`'s sequence never come (its target's plain
        steps there sent none: `runtime.speculative.DraftClient.taps`): no proposal reads
        them (their keys are computed all the same, from whatever the store holds, and
        masked), every other row as before."""
        if not 0 <= slot < self.slots or not 0 <= start < end <= self.max_len:
            raise ValueError(f"gap: slot {slot} / rows {start}..{end} outside "
                             f"0..{self.slots - 1} / 0..{self.max_len}")
        self.known[slot, start:end] = False
        self.holes[slot] = True

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the captured steps once (compilation, capture) on rows no sequence holds yet, at
        the first KV bucket (where every sequence starts): on a GPU the step of each slot and
        the batched step of each padded count up to the slots (a first proposal of several
        contexts cost 222 ms on an H200 uncaptured), as many as their outputs fit in half of
        `BATCH_GRAPH_BYTES` each (a draft of a large vocabulary); longer contexts capture
        theirs on first use."""
        if not self.static:
            return
        b = self.block_size
        one = (b - 1) * self.cfg.model.vocab_size * self.embed.element_size()  # (logits)
        budget = BATCH_GRAPH_BYTES // 2
        singles = max(1, min(self.slots, budget // one)) if self.capture else 1
        for slot in range(singles):
            self.logits(slot, 0, 1, b - 1)
        used = 0
        for sp in BATCH_BUCKETS if self.capture and self.slots > 1 else ():
            n = min(sp, self.slots)
            used += sp * one
            if batch_bucket(n) != sp or used > budget:
                break
            self._static_scores_batch([(slot, 0, 1) for slot in range(n)])
        for slot in range(self.slots):
            self.begin(slot)

    def write_features(self, slot: int, column: int, pos: int, rows: torch.Tensor) -> None:
        """Rows (n, w) of some tapped layers, for positions [pos, pos + n) of `slot`'s
        sequence, at `column`."""
        n, w = rows.shape
        self.features[0, slot, pos:pos + n, column:column + w].copy_(rows, non_blocking=True)

    def _block_ids(self, token: torch.Tensor, m: int) -> torch.Tensor:
        mask = torch.full((m - 1,), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        return torch.cat([token.reshape(1), mask])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        return x * self.cfg.embedding_scale if self.cfg.embedding_scale != 1.0 else x

    @torch.inference_mode()
    def propose(self, slot: int, token: int, pos: int, n: int, tokens: torch.Tensor | None = None,
                start: int = 0, tree: int = 0,
                kept: list[int] | None = None
                ) -> tuple[list[int], list[int] | None, list | None]:
        self._check(slot, pos, n)
        if kept:
            self.commit(slot, pos, kept)
        logits, top = self._scores(slot, token, pos, n)
        return self._finish(slot, logits, top, pos, n, tree)

    def batches(self, n: int) -> bool:
        """Whether proposals of n tokens of several contexts run as one step here
        (`propose_batch`): on a GPU, each a whole block (the captured path). On the CPU each
        proposal runs alone, so its rounding never depends on what else was asked."""
        return self.capture and n == self.block_size - 1

    @torch.inference_mode()
    def propose_batch(self, reqs: Sequence[tuple[int, int, int, int, int, list[int] | None]]
                      ) -> list[tuple[list[int], list[int] | None, list | None]]:
        """`propose` for several contexts at once, each (slot, token, pos, n, tree, kept): one
        batched step (`draft.dflash.draft_step_batch`, a graph per padded count and KV bucket)
        where `batches(n)` holds for them all and the slots differ, else one by one. Every
        request is checked, and its kept rows moved, before any is computed."""
        for slot, _, pos, n, _, kept in reqs:
            self._check(slot, pos, n)
        if len(reqs) < 2 or len({r[0] for r in reqs}) != len(reqs) or \
                not self.static or not all(n == self.block_size - 1 for _, _, _, n, _, _ in reqs):
            return [self.propose(slot, token, pos, n, None, 0, tree, kept)
                    for slot, token, pos, n, tree, kept in reqs]
        for slot, _, pos, _, _, kept in reqs:
            if kept:
                self.commit(slot, pos, kept)
        logits, top = self._static_scores_batch([(r[0], r[1], r[2]) for r in reqs])
        # the greedy proposals' ranked ids read from the device once for them all (a sampled
        # one reads what it draws itself, `_sampled`)
        greedy = top is not None and all(self.sampling[r[0]] is None for r in reqs)
        ranked = top[:len(reqs)].tolist() if greedy else [None] * len(reqs)
        return [self._finish(slot, logits[i], top[i], pos, n, tree, ranked[i])
                for i, (slot, _, pos, n, tree, _) in enumerate(reqs)]

    def _finish(self, slot: int, logits: torch.Tensor, top: torch.Tensor | None, pos: int,
                n: int, tree: int, ranked: list[list[int]] | None = None
                ) -> tuple[list[int], list[int] | None, list | None]:
        """A proposal from the draft's logits (n, V) of its n tokens (and their top ids;
        `ranked`: those ids already on the host)."""
        shape = self.cfg.spec_tree
        chain = not tree or shape is None
        sample = self.sampling[slot]
        if sample is not None:
            return self._sampled(logits, top, pos, n, None if chain else tree, sample)
        if ranked is None and top is not None:
            ranked = top.tolist()
        if chain:
            if ranked is None:
                return logits.argmax(-1).tolist(), None, None
            return [row[0] for row in ranked], None, None
        if ranked is None:
            ranked = logits.topk(self.top_k, dim=-1).indices.tolist()
        return (*instantiate(shape, ranked, tree, n), None)

    def _sampled(self, logits: torch.Tensor, top: torch.Tensor | None, pos: int, n: int,
                 tree: int | None, sample: dict) -> tuple[list[int], list[int] | None, list]:
        """A proposal drawn from the draft's own distribution at the sequence's sampling
        (`shards.spec_sampling.sample_tree`): the tree's shape (or a chain of n), each node's
        children drawn without replacement (`mode` coupled: with the target's noise, no q),
        the draft's ranked guesses past q's support."""
        k = 1 if tree is None else self.top_k
        if tree is None:
            nodes, parents = n, None
        else:
            dummy = [[0] * k for _ in range(n)]
            toks, parents = instantiate(self.cfg.spec_tree, dummy, tree, n)
            nodes = len(toks)
        fixed = top[:, :k] if top is not None else logits.topk(k, dim=-1).indices
        ids, probs = proposal_q(logits.float(), float(sample["temperature"]),
                                int(sample["top_k"]), float(sample["top_p"]))
        # (coupled: the target's noise at the draft's candidates, on any device)
        coupled = logits.shape[-1] if sample["mode"] == "coupled" else 0
        tokens, q = sample_tree(parents, nodes, ids, probs, fixed, int(sample["seed"]), pos,
                                coupled)
        return tokens, parents, q

    def _check(self, slot: int, pos: int, n: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"propose: slot {slot} outside 0..{self.slots - 1}")
        if not 1 <= pos < self.max_len or not 1 <= n < self.block_size:
            raise ValueError(f"propose: position {pos} / {n} tokens outside 1..{self.max_len - 1}"
                             f" / 1..{self.block_size - 1}")

    def commit(self, slot: int, pos: int, kept: list[int]) -> None:
        """Move the feature rows the last tree verify step kept (rows `kept` of the step before
        `pos`) to their positions (`shards.spec_tree.kept_moves`); checked before anything
        moves."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"propose: slot {slot} outside 0..{self.slots - 1}")
        src, dst = kept_moves(pos, kept)
        if not src:
            return
        if not all(0 <= r < self.max_len for r in (*src, *dst)):
            raise ValueError(f"propose: kept rows {src} -> {dst} outside the context of "
                             f"{self.max_len}")
        idx = to_device([*src, *dst], self.device)
        s, d = idx[:len(src)], idx[len(src):]
        self.features[0, slot, d] = self.features[0, slot, s]

    @torch.inference_mode()
    def logits(self, slot: int, token: int, pos: int, n: int) -> torch.Tensor:
        """(n, V) logits of the draft tokens for positions pos+1 .. pos+n of `slot`'s
        sequence."""
        self._check(slot, pos, n)
        return self._scores(slot, token, pos, n)[0]

    def _scores(self, slot: int, token: int, pos: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits, and on the captured path each row's `top_k` best ids (else None)."""
        m = n + 1
        self.done[slot] = min(self.done[slot], pos)
        if self.static and n == self.block_size - 1:
            return self._static_scores(slot, token, pos)
        done = self.done[slot]
        if done < pos:
            self.draft.write_context(self.features[0, slot, done:pos], done, self.kv, slot)
            self.done[slot] = pos
        ids = self._block_ids(torch.tensor([token], device=self.device), m)
        known = self.known[slot] if self.holes[slot] else None
        h = self.draft.block(self._embed(ids), block_step(pos, m, self.device, known), self.kv,
                             slot)
        return h[1:] @ self.head.T, None

    # ---- the captured path (GPU): new context rows and the block in one graph ----------------
    def _use_compiled(self, on: bool) -> None:
        """The whole step (`draft.dflash.draft_step`) as one torch.compile'd function, dynamic
        in the cache's bucket of keys (one compilation serves every bucket), or eager."""
        self.compiled = on
        self._step = torch.compile(draft_step, fullgraph=True) if on else draft_step
        self._forget_graphs()

    def _graph_step(self, slot: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, d, m = self.block_size, self.draft, self.cfg.model
        keys, values = self.kv.k[:, slot, :kv_len], self.kv.v[:, slot, :kv_len]
        if self.compiled:
            torch._dynamo.mark_dynamic(keys, 1)
            torch._dynamo.mark_dynamic(values, 1)
        k, v, logits, top = self._step(
            self.features[0, slot], self._done_t, self._pos_t, self.known[slot], self._ids[:b],
            keys, values,
            self.embed, d.fc.weight, d.hidden_norm.weight, self._kv_weights, self._layers,
            d.inv_freq, d.norm.weight, self.head, m.rms_norm_eps, m.num_heads, m.num_kv_heads,
            m.head_dim, self.cfg.embedding_scale, self.top_k, self._kinds)
        # rows past the proposal's position are junk: seen by no block, rewritten by the next
        ctx_pos = self._done_t + self._rows[:b]
        self.kv.k[:, slot].index_copy_(1, ctx_pos, k)
        self.kv.v[:, slot].index_copy_(1, ctx_pos, v)
        return logits, top

    def _static_scores(self, slot: int, token: int, pos: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        done = self.done[slot]
        if pos - done > self.block_size:  # a long new context (a prompt): eagerly first
            self.draft.write_context(self.features[0, slot, done:pos], done, self.kv, slot)
            done = pos
        self._done_t.fill_(done)
        self._pos_t.fill_(pos)
        self._ids[:1].fill_(token)
        kv_len = min(-(-(pos + self.block_size) // self.bucket) * self.bucket, self.kv.max_len)
        if not self.capture:
            out = self._graph_step(slot, kv_len)
            self.done[slot] = pos
            return out
        key = (slot, kv_len, self.block_size)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = capture(lambda: self._graph_step(slot, kv_len), self.pool)
            except Exception as e:
                if not self.compiled or isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                log.warning("torch.compile of the draft's step failed (%s: %s); running it "
                            "eager", type(e).__name__, e)
                self._use_compiled(False)
                entry = capture(lambda: self._graph_step(slot, kv_len), self.pool)
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        self.done[slot] = pos  # (only now: a step that failed left its rows to the next one)
        return out


    # ---- batched proposals (GPU): several contexts' steps in one graph ----------------------
    def _batch_input(self, sp: int) -> tuple[torch.Tensor, ...]:
        bufs = self.batch_inputs.get(sp)
        if bufs is None:
            z = torch.zeros(sp, dtype=torch.long, device=self.device)
            ids = torch.full((sp, self.block_size), self.cfg.mask_token_id, dtype=torch.long,
                             device=self.device)
            bufs = self.batch_inputs[sp] = (z, z.clone(), z.clone(), ids)
        return bufs

    def _graph_step_batch(self, sp: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, d, m = self.block_size, self.draft, self.cfg.model
        slots, done, pos, ids = self._batch_input(sp)
        k, v, logits, top = draft_step_batch(
            self.features[0], slots, done, pos, self.known[slots, :kv_len], ids,
            self.kv.k[:, slots, :kv_len], self.kv.v[:, slots, :kv_len], self.embed,
            d.fc.weight, d.hidden_norm.weight, self._kv_weights, self._layers, d.inv_freq,
            d.norm.weight, self.head, m.rms_norm_eps, m.num_heads, m.num_kv_heads, m.head_dim,
            self.cfg.embedding_scale, self.top_k, self._kinds)
        # each context's new rows at [done, done + b) (past its position: junk, as alone)
        ctx_pos = done[:, None] + self._rows[:b]
        self.kv.k[:, slots[:, None], ctx_pos] = k
        self.kv.v[:, slots[:, None], ctx_pos] = v
        return logits, top

    def _static_scores_batch(self, reqs: Sequence[tuple[int, int, int]]
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_static_scores` of several contexts (slot, token, pos), distinct slots: logits
        (S, block - 1, V) and top ids (S, block - 1, k). Padding contexts repeat the first's
        slot at the cache's rows past every context (`context_len`), which no proposal reads."""
        b = self.block_size
        for slot, _, pos in reqs:
            self.done[slot] = min(self.done[slot], pos)
            done = self.done[slot]
            if pos - done > b:  # a long new context (a prompt): eagerly first
                self.draft.write_context(self.features[0, slot, done:pos], done, self.kv, slot)
                self.done[slot] = pos
        sp = batch_bucket(len(reqs))
        pad = sp - len(reqs)
        host = torch.tensor([[slot, self.done[slot], pos, token] for slot, token, pos in reqs] +
                            [[reqs[0][0], self.context_len, self.context_len,
                              self.cfg.mask_token_id]] * pad, dtype=torch.long)
        slots, done, pos, ids = self._batch_input(sp)
        vals = host.pin_memory().to(self.device, non_blocking=True) if self.capture else \
            host.to(self.device)
        slots.copy_(vals[:, 0])
        done.copy_(vals[:, 1])
        pos.copy_(vals[:, 2])
        ids[:, 0].copy_(vals[:, 3])
        top_pos = max(p for _, _, p in reqs)
        kv_len = min(-(-(top_pos + b) // self.bucket) * self.bucket, self.kv.max_len)
        if not self.capture:
            logits, top = self._graph_step_batch(sp, kv_len)
        else:
            entry = self.batch_graphs.get((sp, kv_len))
            if entry is None:
                entry = capture(lambda: self._graph_step_batch(sp, kv_len), self.pool)
            keep_recent(self.batch_graphs, (sp, kv_len), entry, BATCH_GRAPH_BYTES,
                        lambda e: e[1][0].numel() * e[1][0].element_size())
            graph, (logits, top) = entry
            graph.replay()
        for slot, _, p in reqs:  # (only now: a step that failed left its rows to the next one)
            self.done[slot] = p
        return logits[:len(reqs)], top[:len(reqs)]


class ClassicProposer:
    kind = "classic"

    def __init__(self, model, max_len: int, device: torch.device, graphs: bool,
                 block_size: int = CLASSIC_BLOCK) -> None:
        self.model, self.max_len, self.device = model, max_len, device
        self.static_decode = graphs
        self.block_size = block_size
        self.set_slots(1)

    def set_slots(self, slots: int) -> None:
        self.slots = slots
        self.ex = None  # (free the old cache first)
        self.ex = RangeExecutor(self.model, self.max_len + self.block_size, slots,
                                device=self.device, static_decode=self.static_decode)

    def begin(self, slot: int, sample: dict | None = None) -> None:
        # (its proposals are best guesses always) the coordinator says where the draft's own KV
        # is valid (`start`)
        pass

    @torch.inference_mode()
    def propose(self, slot: int, token: int, pos: int, n: int,
                tokens: torch.Tensor | None = None, start: int = 0, tree: int = 0,
                kept: list[int] | None = None) -> tuple[list[int], list[int] | None, None]:
        """A chain always (`tree` and `kept` do not apply: it proposes no trees)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"propose: slot {slot} outside 0..{self.slots - 1}")
        if pos + n > self.ex.max_len or n < 1:
            raise ValueError(f"propose: {n} tokens after position {pos} exceed the draft's "
                             f"context of {self.ex.max_len}")
        given = [] if tokens is None else tokens.tolist()
        if start + len(given) != pos:
            raise ValueError(f"propose: tokens cover [{start}, {start + len(given)}), "
                             f"expected [{start}, {pos})")
        hybrid = self.ex.kv if self.ex.hybrid else None
        if hybrid is not None:  # the state after the last kept row of the last proposal
            hybrid.settle(slot, start, None)
        for a, b in prefill_chunks(given, 0, len(given), CLASSIC_CHUNK, ()):
            self.ex.run(torch.tensor(given[a:b]), start + a, slot)
        out, x, states = [], token, []
        for j in range(n):
            logits = self.ex.run(torch.tensor([x]), pos + j, slot)
            if hybrid is not None:
                states.append(hybrid.save(slot))
            x = int(logits[-1].argmax())
            out.append(x)
        if hybrid is not None:  # the next proposal's `start` says how many rows were kept
            hybrid.keep_rows(slot, pos, states)
        return out, None, None


def _target_tensors(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ckpt.config
    shape = (cfg.vocab_size, cfg.hidden_size)
    names = ("model.embed_tokens.weight", "lm_head.weight")
    t = ckpt.load(dict.fromkeys(names, shape), {n: source_name(cfg, n) for n in names}, dtype,
                  device)
    return t[names[0]], t[names[1]]


def load_proposer(draft: str | Path, target: str | Path, device: str, dtype: torch.dtype,
                  max_len: int, graphs: bool = True, block_size: int | None = None,
                  seed: int = 0, compile: bool = True,
                  dflash_class: type[DFlashProposer] = DFlashProposer) -> Proposer:
    """Open a draft checkpoint for `target`: a DFlash folder (or `random:NAME`, seeded random
    weights of a DFlash preset), or any model (classic). `compile`: a DFlash draft's captured
    step through torch.compile (False: captured eager). `dflash_class`: what runs a DFlash
    draft (the bench oracle's, `draft.oracle`)."""
    dev = torch.device(device)
    path = Path(draft)
    target_ckpt = open_checkpoint(target, seed)
    folder = dflash_folder(draft)
    if folder is not None:
        cfg = read_dflash_config(folder)
        cfg.check_target(target_ckpt.config, folder / "config.json")
        model = load_dflash(folder, cfg, dtype, dev,
                            seed if str(draft).startswith(RANDOM_PREFIX) else None)
        if dev.type == "cuda":
            from layersplit.shards.fused import fuse_projections

            fuse_projections(model, compile=graphs and compile)
        embed, head = _target_tensors(target_ckpt, dtype, dev)
        p = dflash_class(model, embed, head, max_len, dev, graphs and dev.type == "cuda",
                         compile=compile)
        if block_size is not None:
            p.block_size = max(2, min(block_size, cfg.block_size))
        log.info("DFlash draft %s: %d layers, block %d, taps %s", path.name,
                 cfg.model.num_layers, p.block_size, list(cfg.target_layer_ids))
        return p
    ckpt = open_checkpoint(path, seed)
    tc = target_ckpt.config
    if ckpt.config.vocab_size != tc.vocab_size:
        raise CheckpointError(f"{path}: draft vocab_size {ckpt.config.vocab_size} != the "
                              f"target's {tc.vocab_size}")
    # (the same tokens, not only as many: the coordinator checks that before it starts this
    # process, `runtime.draft_link.check_same_vocab`)
    model = load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, dev)
    block = block_size or CLASSIC_BLOCK
    log.info("classic draft %s: %d layers, %d tokens per proposal", path.name,
             ckpt.config.num_layers, block - 1)
    return ClassicProposer(model, max_len, dev, graphs and dev.type == "cuda", block)
