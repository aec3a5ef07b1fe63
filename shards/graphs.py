"""Decode and verify steps through CUDA graphs: one graph per (KV-length bucket, rows), captured
on first use.

A decode step (one token) of a layer range is a few hundred small kernels; launched one by one
from Python they cost more than the math. Captured once and replayed, they cost one launch. The
graph reads its tokens (or hidden rows) and first position from static device buffers, writes
its KV rows with `index_copy_` and attends a fixed number of keys (the bucket) under a mask, so
one graph serves every position of its bucket (`StepInfo.static`). A speculative verify step is
the same with a few rows (the last token and the draft tokens); the rows of tapped layers (fed
to a feature-conditioned draft) are outputs of the graph.

A batched decode step (continuous batching) runs one token of each of several sequences, each
in its own KV slot at its own position, as one graph over a window of slots [lo, lo + Bp): Bp
is a bucket (`batch_window`), the window's slots not in the batch are padding rows that write
only the scratch row of their slot (`StepInfo.batched`). Positions are a device buffer, so one
graph per (lo, Bp, KV-length bucket) serves every mix of positions in that bucket.

Over a paged KV cache (`shards.paged_kv`, a shard's) the graphs do not depend on the slot: the
step reads each sequence's block table from a static buffer (`StepInfo.tables`) filled before
the replay, so one graph per (rows, KV-length bucket) serves every slot, and one per (padded
batch size, KV-length bucket) every batch: the bucket bounds the blocks a step reads, and the
batch is its sequences in any slots, padded with rows whose table is all scratch block.
The verify steps of several speculating sequences run the same way, as one batched verify
step (`run_verify_batch`, `StepInfo.batched_tree`): one graph per (padded batch, rows per
sequence, KV-length bucket), each sequence's rows, positions, tree and table in static buffers.

A hybrid range (`shards.models.qwen3_5`) captures its one-token decode steps too, a graph per
(slot, KV-length bucket): its linear layers' conv and recurrent states are the slot's own,
advanced in place by the step, so the slot is part of the graph (`per_slot`); its buckets are
`HYBRID_BUCKET_FACTOR` times wider, so slots x buckets stays a few hundred graphs at 32K. Its
chain verify steps are graphs per (bucket, rows) over a paged cache (the slot whose states they
read a graph input), captured at start with the decode steps' (`warm`): they leave the slot's
states as they were and write the states after each row into `keep_buffers`, which the
executor hands to the cache (`HybridState.keep_rows`). Its batched decode steps are one graph
per (padded batch, bucket) as a dense range's, with each row's state slot a graph input
(`StepInfo.states`; padding rows advance the cache's scratch slot). Tree verify steps stay
eager.

`StaticDecoder` is the seam: on CPU it runs the same static step without capture, which the
tests compare with the eager path; on CUDA it captures and replays.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from layersplit.shards.device import to_device
from layersplit.shards.kv_cache import KVCache
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.models import LayerRange
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.spec_tree import ancestors, depths

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, dict[int, torch.Tensor]]
BatchGraph = tuple[torch.cuda.CUDAGraph, Outputs]  # a batched step's graph, output and
# tapped rows

BATCH_BUCKETS = (2, 4, 8, 16, 32, 64)  # padded batch sizes; above 64, multiples of 64
# A hybrid range's graphs are per slot, so each KV bucket costs a capture in every slot; its
# buckets are this many times the configured one (1,024 keys by default): a quarter of the
# graphs and captures, for a few hundred masked keys more in its few attention layers a step.
HYBRID_BUCKET_FACTOR = 4
# `warm` captures at most this many graphs, holding at most this many bytes of output rows
WARM_GRAPHS = 1024
WARM_OUTPUT_BYTES = 1 << 30
SLOW_CAPTURE_S = 1.0  # a capture at start this long is logged with its key (it compiled)
# batched verify graphs hold their output rows (bp x n rows of logits on the last range: 65 MB
# for 8 x 16 rows of a 128K vocabulary) as long as they are kept: past this many bytes of them,
# the least recently replayed goes (captured again when a step needs it)
VBATCH_OUTPUT_BYTES = 1 << 30
# KV-length buckets are multiples of the bucket up to this many buckets; past that, each doubling
# of the length is split into this many buckets (a step attends at most 1/8 more keys than it
# has), so a 128K context takes 56 graphs of each kind, not 512
LINEAR_BUCKETS = 16
BUCKETS_PER_DOUBLING = 8


def warm_left(elapsed: float, done: int, total: int, estimate_s: float | None) -> float:
    """Seconds a warm-up of `total` captures has left after `done` in `elapsed` seconds: at the
    pace so far (the first captures also compile, so it overestimates), capped by what is left
    of `estimate_s` (an earlier warm-up's time, compiles included) where there is one."""
    pace = elapsed / max(done, 1) * max(total - done, 0)
    if estimate_s is not None:
        return min(pace, max(0.0, estimate_s - elapsed))
    return pace


def kv_buckets(bucket: int, max_len: int) -> list[int]:
    """Every KV length a step may attend (ascending, the last `max_len`): multiples of `bucket`
    up to LINEAR_BUCKETS of them, then BUCKETS_PER_DOUBLING per doubling."""
    out, t = [], bucket
    while t < max_len:
        out.append(t)
        width = bucket if t < LINEAR_BUCKETS * bucket else \
            max(1, (1 << (t.bit_length() - 1)) // BUCKETS_PER_DOUBLING // bucket) * bucket
        t = -(-(t + 1) // width) * width
    out.append(max_len)
    return out


def batch_bucket(n: int) -> int:
    """The smallest padded batch size that holds n rows."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // 64) * 64


def batch_window(slots: Sequence[int], n_slots: int) -> tuple[int, int]:
    """(lo, Bp): the window of slots [lo, lo + Bp) a batched step over `slots` runs on.

    Bp is the bucket of the slots' span (the whole cache when that is no smaller), and the
    window stays inside the cache's `n_slots` slots; a graph is captured per window."""
    if not slots or len(set(slots)) != len(slots):
        raise ValueError(f"a batched step needs distinct slots, got {list(slots)}")
    first, last = min(slots), max(slots)
    if first < 0 or last >= n_slots:
        raise ValueError(f"slots {list(slots)} outside the cache's {n_slots} slots")
    bp = batch_bucket(last - first + 1)
    if bp >= n_slots:
        return 0, n_slots
    return min(first, n_slots - bp), bp


def keep_recent(graphs: dict[Hashable, Any], key: Hashable, entry: Any, budget: int,
                size: Callable[[Any], int]) -> None:
    """`graphs[key] = entry` as the most recently used, then the least recently used others
    dropped (their memory back to the pool) while the entries' `size` exceeds `budget`. The
    entry replayed last again (a steady batch) costs nothing: the budget held at its insert."""
    if graphs and next(reversed(graphs)) == key and graphs[key] is entry:
        return
    graphs.pop(key, None)
    graphs[key] = entry
    held = sum(size(e) for e in graphs.values())
    for old in list(graphs)[:-1]:
        if held <= budget:
            break
        held -= size(graphs.pop(old))


def _output_bytes(out: Outputs) -> int:
    """Bytes of a graph's output rows and tapped rows."""
    rows, taps = out
    return sum(t.numel() * t.element_size() for t in (rows, *taps.values()))


class CaptureFailed(RuntimeError):
    """A graph's capture (or its warm-up runs) failed: nothing of the step it was for ran past
    them (a hybrid range's warm-up runs advance only scratch states), so its caller may run the
    step another way."""


def capture(fn, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture `fn()` in a CUDA graph after two warm-up runs on a side stream; returns the graph
    and what `fn` returned (static tensors that each replay overwrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call of another thread meanwhile (the snapshot thread's pinned
    # allocations and copies) neither fails nor invalidates this capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class StaticDecoder:
    def __init__(self, model: LayerRange, kv: KVCache | PagedKVCache, bucket: int = 256,
                 taps: tuple[int, ...] = (), per_slot: bool = False) -> None:
        """`per_slot`: a graph per slot even over a paged cache (a hybrid range: its layers'
        recurrent states are the slot's, read and written in place by the captured step; the
        cache is then a `HybridState`, whose `save` / `load` keep them across a capture)."""
        self.model, self.kv, self.bucket = model, kv, bucket
        self.per_slot = per_slot
        self.step_bucket = bucket * HYBRID_BUCKET_FACTOR if per_slot else bucket
        self.buckets = kv_buckets(self.step_bucket, kv.max_len)
        self.taps = tuple(t for t in taps if model.start <= t < model.end)
        dev = kv.k_store.device
        self.paged = isinstance(kv, PagedKVCache)
        self.tables: dict[int, torch.Tensor] = {}  # paged: sequences -> static (S, W) buffer
        self.capture = dev.type == "cuda"
        self.inputs: dict[int, torch.Tensor] = {}  # rows -> static input buffer
        self.tree_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> buffers
        self.trees: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # on device
        self.loaded: dict[int, tuple[int, ...]] = {}  # rows -> the tree in the input buffers
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        # batched steps: Bp -> (input rows, positions), and (lo, Bp, kv_len) -> graph, output
        self.batch_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batch_states: dict[int, torch.Tensor] = {}  # hybrid: Bp -> each row's state slot
        self.batch_graphs: dict[tuple[int, int, int], BatchGraph] = {}
        # batched verify steps (paged): (Bp, n) -> (input rows, (2, Bp, n) rows and positions,
        # (Bp, n, n) ancestors), the trees loaded, and (Bp, n, kv_len) -> graph, outputs
        self.vbatch_inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]] = {}
        self.vbatch_trees: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        self.vbatch_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # a hybrid range's chain verify steps: the (conv, state) after each row
        # (`HybridRange.new_keep`), one pair for every slot, bucket and rows (graph inputs),
        # as many rows as the longest step yet; over a paged cache the slot whose states a
        # verify graph reads (a graph input, so one graph serves every slot); its graphs,
        # (slot or -1, KV length, rows) -> graph, outputs, at most VBATCH_OUTPUT_BYTES of
        # outputs held (`keep_recent`)
        self.keep: tuple[torch.Tensor, torch.Tensor] | None = None
        self.verify_slot = torch.zeros(1, dtype=torch.long, device=dev)
        # a hybrid range's graphs of a kind ("verify", "batch") whose capture at start failed:
        # the executor runs those steps another way (`RangeExecutor._static_step`, `_run_batch`)
        self.failed: set[str] = set()
        self.verify_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph,
                                                             Outputs]] = {}

    def kv_len(self, pos: int, n: int = 1) -> int:
        """The KV length (bucket, `kv_buckets`) a step of n rows at `pos` attends."""
        return self.buckets[bisect.bisect_left(self.buckets, pos + n)]

    def _zeros(self, n: int) -> torch.Tensor:
        """A static input buffer of n rows: token ids on the first range, else hidden rows."""
        dev = self.kv.k_store.device
        if self.model.is_first:
            return torch.zeros(n, dtype=torch.long, device=dev)
        return torch.zeros(n, self.model.cfg.hidden_size, dtype=self.kv.k_store.dtype, device=dev)

    def _input(self, n: int) -> torch.Tensor:
        x = self.inputs.get(n)
        if x is None:
            x = self.inputs[n] = self._zeros(n)
        return x

    def _tree_input(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static (depth, ancestors) buffers of n-row verify steps."""
        bufs = self.tree_inputs.get(n)
        if bufs is None:
            dev = self.kv.k_store.device
            bufs = self.tree_inputs[n] = (torch.zeros(n, dtype=torch.long, device=dev),
                                          torch.zeros(n, n, dtype=torch.bool, device=dev))
        return bufs

    def _load_tree(self, n: int, parents: Sequence[int] | None) -> None:
        key = tuple(range(n - 1)) if parents is None else tuple(parents)
        if self.loaded.get(n) == key:  # the buffers hold it still (a draft's tree shape is fixed)
            return
        src = self.trees.get(key)
        if src is None:
            if len(self.trees) >= 64:
                self.trees.clear()
            dev = self.kv.k_store.device
            src = self.trees[key] = (torch.tensor(depths(key), device=dev),
                                     ancestors(key).to(dev))
        depth, anc = self._tree_input(n)
        depth.copy_(src[0])
        anc.copy_(src[1])
        self.loaded[n] = key

    def _tables(self, seqs: int) -> torch.Tensor:
        """The static block-table buffer of steps over `seqs` sequences (paged)."""
        t = self.tables.get(seqs)
        if t is None:
            t = self.tables[seqs] = torch.full((seqs, self.kv.table.shape[1]),
                                               self.kv.num_blocks, dtype=torch.long,
                                               device=self.kv.table.device)
        return t

    def keep_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers a hybrid range's n-row chain verify graphs write each row's states into:
        the first n rows of one pair for every slot and n (the next verify replay, of any
        slot, overwrites them). A step longer than any before gets a pair of its length; the
        verify graphs captured over the old pair go (captured again at their next need)."""
        if self.keep is None or self.keep[1].shape[1] < n:
            self.verify_graphs.clear()
            self.keep = None  # (the old pair freed first, unless a slot's pending rows, views
            # of it, keep it until that slot settles)
            self.keep = self.model.new_keep(self.kv, n)
            log.info("layers %d:%d: the states after each row of a %d-row verify step: %.0f MB",
                     self.model.start, self.model.end, n,
                     sum(t.numel() * t.element_size() for t in self.keep) / 2**20)
        conv, state = self.keep
        return conv[:, :n], state[:, :n]

    def _step(self, slot: int, kv_len: int, n: int) -> Outputs:
        if n > 1:
            step = StepInfo.static_tree(self.pos, *self._tree_input(n), kv_len)
        else:
            step = StepInfo.static(self.pos, n, kv_len)
        if self.paged:
            step.tables = self._tables(1)
        taps: dict[int, torch.Tensor] = dict.fromkeys(self.taps)
        keep = {}
        if self.per_slot and n > 1:  # a hybrid chain's verify step
            keep["keep"] = self.keep_buffers(n)
            if self.paged:
                step.states = self.verify_slot
        out = self.model(self._input(n), step, self.kv, slot, logit_rows=slice(0, n), taps=taps,
                         **keep)
        return out, taps

    @torch.inference_mode()
    def run(self, x: torch.Tensor, pos: int, slot: int = 0,
            parents: Sequence[int] | None = None) -> Outputs:
        """Hidden rows (or logits of every row, on the last range) of a step of len(x) rows at
        positions [pos, pos + len(x)), and the rows of this range's tapped layers. A step of
        several rows is a verify step: a chain, or the token tree `parents`
        (`shards.spec_tree`). On CUDA these are the graph's static output buffers: the next
        replay of any graph of this decoder may overwrite them (captures share one memory
        pool), so a caller that keeps them past that copies them."""
        n = x.shape[0]
        self._input(n).copy_(x.reshape(self._input(n).shape))
        self.pos.fill_(pos)
        if n > 1:
            self._load_tree(n, parents)
        kv_len = self.kv_len(pos, n)
        if self.paged:  # the slot's table into the graph's buffer: one graph for every slot
            if pos + n > self.kv.capacity(slot):
                raise IndexError(f"rows {pos}..{pos + n} outside slot {slot}'s block table of "
                                 f"{self.kv.capacity(slot)} rows")
            self._tables(1).copy_(self.kv.table[slot:slot + 1])
        verify = self.per_slot and n > 1  # (a hybrid chain's)
        if verify and self.paged:
            self.verify_slot.fill_(slot)
        if not self.capture:
            return self._step(slot, kv_len, n)
        graph_slot = -1 if self.paged and (verify or not self.per_slot) else slot
        graph, out = (self._verify_graph if verify else self._step_graph)(graph_slot, kv_len, n)
        graph.replay()
        return out

    def _verify_graph(self, graph_slot: int, kv_len: int, n: int
                      ) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """The graph of a hybrid range's n-row chain verify step over `kv_len` keys (in
        `graph_slot`, or -1: any slot of a paged cache, `verify_slot`), captured at its first
        need: it reads the slot's states and writes `keep_buffers`, not the states; the least
        recently replayed go past VBATCH_OUTPUT_BYTES of outputs held."""
        key = (graph_slot, kv_len, n)
        entry = self.verify_graphs.get(key)
        if entry is None:
            self.keep_buffers(n)  # (a longer pair first: it clears the graphs)
            entry = capture(lambda: self._step(graph_slot, kv_len, n), self.pool)
            log.debug("captured a %d-row verify graph for layers %d:%d, %d keys", n,
                      self.model.start, self.model.end, kv_len)
        keep_recent(self.verify_graphs, key, entry, VBATCH_OUTPUT_BYTES,
                    lambda e: _output_bytes(e[1]))
        return entry

    def _step_graph(self, graph_slot: int, kv_len: int, n: int
                    ) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """The graph of an n-row step over `kv_len` keys in `graph_slot` (-1: any slot of a
        paged cache), captured at its first need. A hybrid range's step advances its slot's
        states: the capture's warm-up runs leave them as they were (a replay takes the step)."""
        key = (graph_slot, kv_len, n)
        entry = self.graphs.get(key)
        if entry is None:
            saved = self.kv.save(graph_slot) if self.per_slot else None
            try:
                entry = capture(lambda: self._step(graph_slot, kv_len, n), self.pool)
            finally:
                if saved is not None:
                    self.kv.load(graph_slot, saved)
            log.debug("captured a %d-row step graph for layers %d:%d, %d keys", n,
                      self.model.start, self.model.end, kv_len)
            self.graphs[key] = entry
        return entry

    def warm_plan(self, rows: Sequence[int], batch: int, verify_batch: int = 0,
                  max_rows: int = 1 << 30) -> tuple[list[tuple[str, int, int, int]], int]:
        """What `warm` captures: (kind, slot or lo, rows or padded batch, KV length) in order
        of KV length (a batched verify step's: ("vbatch", rows per sequence, padded batch,
        KV length), for up to `verify_batch` sequences of up to `max_rows` rows in all), and
        how many graphs there would be without the caps. Each graph keeps its
        own output rows (logits, on the last range), so at most WARM_GRAPHS graphs holding at
        most WARM_OUTPUT_BYTES of them are captured at start, the shortest buckets first."""
        plan: list[tuple[str, int, int, int]] = []
        slots = range(self.kv.slots) if self.per_slot else [-1 if self.paged else 0]
        for kv_len in self.buckets:
            for n in sorted(set(rows)):
                if self.per_slot and n > 1:  # a hybrid range's chain verify graph: one for
                    # every slot of a paged cache (else captured at first need, per slot)
                    if self.paged and self.model.graph_safe(n):
                        plan.append(("verify", -1, n, kv_len))
                    continue
                plan += [("step", slot, n, kv_len) for slot in slots]
            if self.paged:  # (a hybrid range's too: each row's state slot is a graph input;
                # not where its experts would sync the host, `HybridRange.graph_safe`)
                plan += [("batch", 0, bp, kv_len) for bp in BATCH_BUCKETS
                         if bp <= batch_bucket(batch) and batch >= 2 and
                         (not self.per_slot or self.model.graph_safe(bp))]
            if self.paged and not self.per_slot:
                plan += [("vbatch", n, bp, kv_len) for n in sorted(set(rows))
                         for bp in BATCH_BUCKETS if 1 < n and 2 <= verify_batch and
                         bp <= batch_bucket(verify_batch) and bp * n <= max_rows]
        cfg = self.model.cfg
        row = (cfg.vocab_size * 4 if self.model.is_last else
               cfg.hidden_size * self.kv.k_store.element_size())
        kept, held = [], 0
        for item in plan:
            held += item[2] * (item[1] if item[0] == "vbatch" else 1) * row
            if held > WARM_OUTPUT_BYTES or len(kept) >= WARM_GRAPHS:
                break
            kept.append(item)
        return kept, len(plan)

    def warm(self, rows: Sequence[int] = (1,), batch: int = 0, every_s: float = 5.0,
             label: str = "", verify_batch: int = 0, max_rows: int = 1 << 30,
             estimate_s: float | None = None) -> tuple[int, float]:
        """Capture, before any request, every graph a step may replay: for each KV-length
        bucket up to the cache's length, a step of each of `rows` rows (1: decode; more: a
        verify step of that many) and, over a paged cache, a batched step of each padded batch
        size up to `batch` sequences, and a batched verify step of each verify size for each
        padded batch up to `verify_batch` sequences (`run_verify_batch`; at most `max_rows`
        rows); a hybrid range's one-row steps in every slot, and its chain verify steps (one
        graph for every slot of a paged cache). The first
        capture also compiles the compiled stages (`shards.fused`). Logs progress every
        `every_s` seconds with an estimate of the time left (`warm_left`; `estimate_s`: what
        the same warm-up took before). Returns (graphs captured, seconds). On the CPU nothing
        is captured.

        The capture's runs write their K/V rows where the buffers point (position 0 through
        the scratch block of a paged cache, or row 0 of a slot): nothing a later step reads
        before it writes it; a hybrid range's states are put back."""
        if not self.capture:
            return 0, 0.0
        t0 = last = time.perf_counter()
        plan, wanted = self.warm_plan(rows, batch, verify_batch, max_rows)
        if len(plan) < wanted:
            log.info("%scapturing %d of %d step graphs at start (up to %d keys); the rest on "
                     "first use", label, len(plan), wanted, plan[-1][3] if plan else 0)
        done = 0
        with torch.inference_mode():
            if self.paged:  # every row through the scratch block
                for seqs in {1, *(n for kind, _, n, _ in plan if kind in ("batch", "vbatch"))}:
                    self._tables(seqs).fill_(self.kv.num_blocks)
            self.pos.zero_()
            verify = [n for kind, _, n, _ in plan if kind == "verify"]
            if verify:  # (the keep pair of the longest first: a longer one clears the graphs;
                # the capture's runs read the scratch slot's states)
                self.keep_buffers(max(verify))
                self.verify_slot.fill_(self.kv.scratch_slot)
            for kind, slot, n, kv_len in plan:
                t_item = time.perf_counter()
                if kind == "step" and (slot, kv_len, n) not in self.graphs:
                    if n > 1:  # a chain: no row of the capture's runs sees no key at all (the
                        self._load_tree(n, None)  # torch path's softmax would write NaN rows)
                    self._step_graph(slot, kv_len, n)
                    done += 1
                elif kind == "verify" and (slot, kv_len, n) not in self.verify_graphs:
                    if "verify" not in self.failed:
                        self._load_tree(n, None)
                        done += self._warm_hybrid("verify", lambda: self._verify_graph(
                            slot, kv_len, n), label)
                elif kind == "batch" and (0, n, kv_len) not in self.batch_graphs:
                    if "batch" not in self.failed:
                        x, positions = self._batch_input(n)
                        x.zero_()
                        positions.fill_(0)
                        done += self._warm_hybrid("batch", lambda: self._batch_graph(
                            0, n, kv_len), label)
                elif kind == "vbatch" and (n, slot, kv_len) not in self.vbatch_graphs:
                    x, idx, _ = self._vbatch_input(n, slot)  # (slot: the rows per sequence)
                    x.zero_()
                    idx.fill_(self.kv.scratch_pos)  # every sequence padding: sees every key
                    self._vbatch_graph(n, slot, kv_len)
                    done += 1
                now = time.perf_counter()
                if now - t_item >= SLOW_CAPTURE_S:  # (a capture that compiled or autotuned)
                    log.info("%s%s graph of %d row(s) at %d keys: %.1f s", label, kind, n,
                             kv_len, now - t_item)
                if now - last >= every_s:
                    last = now
                    log.info("%scaptured %d of %d step graphs (%.0f s, about %.0f s left)",
                             label, done, len(plan), now - t0,
                             warm_left(now - t0, done, len(plan), estimate_s))
        torch.cuda.synchronize(self.kv.k_store.device)
        return done, time.perf_counter() - t0

    def _warm_hybrid(self, kind: str, take: Callable[[], Any], label: str) -> int:
        """One capture of `warm`: 1 where it was taken. A hybrid range's verify or batched
        capture that fails is logged, and the graphs of its kind are not tried again (their
        steps run eager: `failed`); a dense range's failure is raised."""
        try:
            take()
            return 1
        except Exception as e:  # noqa: BLE001 - any capture failure: that kind's steps eager
            if not self.per_slot:
                raise
            self.failed.add(kind)
            log.warning("%sa hybrid %s graph failed to capture at start (%s: %s); those steps "
                        "run eager", label, kind, type(e).__name__, e)
            return 0

    def _batch_input(self, bp: int) -> tuple[torch.Tensor, torch.Tensor]:
        bufs = self.batch_inputs.get(bp)
        if bufs is None:
            x = self._zeros(bp)
            bufs = self.batch_inputs[bp] = (x, torch.zeros(bp, dtype=torch.long, device=x.device))
        return bufs

    def _batch_states(self, bp: int) -> torch.Tensor:
        """A hybrid range's batched steps of `bp` rows: the static (bp,) buffer of the slot
        whose states each row advances (`StepInfo.states`)."""
        buf = self.batch_states.get(bp)
        if buf is None:
            buf = self.batch_states[bp] = torch.full((bp,), self.kv.scratch_slot,
                                                     dtype=torch.long,
                                                     device=self.kv.k_store.device)
        return buf

    def _batch_step(self, lo: int, bp: int, kv_len: int) -> Outputs:
        x, positions = self._batch_input(bp)
        step = StepInfo.batched(positions, lo, kv_len)
        if self.paged:
            step.tables = self._tables(bp)
        if self.per_slot:
            step.states = self._batch_states(bp)
        taps: dict[int, torch.Tensor] = dict.fromkeys(self.taps)
        return self.model(x, step, self.kv, lo, taps=taps if taps else None), taps

    def _load_batch(self, x: torch.Tensor, slots: list[int], positions: list[int], lo: int,
                    bp: int) -> torch.Tensor:
        """Fill the static buffers of a batched step over slots [lo, lo + bp); returns each
        given row's index in the window. Padding rows get input zero and the scratch row's
        position, so they write only there."""
        buf, pos = self._batch_input(bp)
        order = to_device([s - lo for s in slots], buf.device)
        padded = [self.kv.scratch_pos] * bp
        for s, p in zip(slots, positions):
            padded[s - lo] = p
        pos.copy_(to_device(padded, pos.device))
        buf.zero_()
        buf.index_copy_(0, order, x.to(buf.device, buf.dtype).reshape(-1, *buf.shape[1:]))
        return order

    @torch.inference_mode()
    def run_batch(self, x: torch.Tensor, slots: list[int], positions: list[int],
                  taps: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step of len(slots) sequences: row i is the token (first range) or hidden
        row of the sequence in slot `slots[i]`, at position `positions[i]`. Returns the output
        rows in that order (a new tensor): hidden (B, hidden), or float32 logits (B, vocab) on
        the last range. With `taps` (a dict), the rows of this range's tapped layers are stored
        in it by global layer index, in that order too (new tensors): sequences that feed the
        draft batch with the others (the graph computes them in any case).

        The rows run padded to a window of slots (`batch_window`); every other slot's KV rows
        [0, max_len) are left as they were."""
        if not len(slots) == len(positions) == x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows, {len(slots)} slots, {len(positions)} positions")
        if not all(0 <= p < self.kv.max_len for p in positions):
            raise ValueError(f"positions {positions} outside the context of {self.kv.max_len}")
        if self.paged:  # rows 0..B-1 of the batch, any slots: their tables into the buffer
            if len(set(slots)) != len(slots) or any(p >= self.kv.capacity(s)
                                                    for s, p in zip(slots, positions)):
                raise ValueError(f"slots {slots} repeated, or positions {positions} outside "
                                 "their block tables")
            lo, bp = 0, batch_bucket(len(slots))
            order = self._load_batch(x, list(range(len(slots))), positions, lo, bp)
            tables = self._tables(bp)
            tables.fill_(self.kv.num_blocks)
            tables[:len(slots)] = self.kv.table[to_device(slots, tables.device)]
        else:
            lo, bp = batch_window(slots, self.kv.slots)
            order = self._load_batch(x, slots, positions, lo, bp)
        kv_len = self.kv_len(max(positions))
        graph = None
        if self.capture:  # (before the states are loaded: a capture's warm-up runs advance them)
            graph, (out, rows) = self._batch_graph(lo, bp, kv_len)
        if self.per_slot:  # each row's states: its sequence's slot; padding rows: scratch
            states = [self.kv.scratch_slot] * bp
            for i, s in enumerate(slots):  # (row i of a paged batch; slot s - lo of a window)
                states[i if self.paged else s - lo] = s
            self._batch_states(bp).copy_(to_device(states, self.kv.k_store.device))
        if graph is None:
            out, rows = self._batch_step(lo, bp, kv_len)
        else:
            graph.replay()
        if taps is not None:
            taps.update({k: v[order] for k, v in rows.items()})
        return out[order]

    def batch_rows(self, slots: Sequence[int]) -> int:
        """The rows a batched step of the sequences in `slots` runs, padding included."""
        return batch_bucket(len(slots)) if self.paged else batch_window(slots, self.kv.slots)[1]

    def _batch_graph(self, lo: int, bp: int, kv_len: int) -> BatchGraph:
        """The graph of a batched step over slots [lo, lo + bp) and `kv_len` keys, captured at
        its first need."""
        key = (lo, bp, kv_len)
        entry = self.batch_graphs.get(key)
        if entry is None:
            if self.per_slot:  # (the warm-up runs advance the scratch slot's states only)
                self._batch_states(bp).fill_(self.kv.scratch_slot)
            try:
                entry = capture(lambda: self._batch_step(lo, bp, kv_len), self.pool)
            except Exception as e:
                if not self.per_slot:
                    raise
                raise CaptureFailed(f"{type(e).__name__}: {e}") from e
            log.debug("captured a %d-slot batched step graph for layers %d:%d, slots %d:%d, "
                      "%d keys", bp, self.model.start, self.model.end, lo, lo + bp, kv_len)
            self.batch_graphs[key] = entry
        return entry

    # ---- batched verify steps (paged) ----------------------------------------------------------
    def _vbatch_input(self, bp: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static buffers of a batched verify step of `bp` sequences of n rows: input rows,
        (2, bp, n) KV rows and positions, (bp, n, n) ancestors."""
        bufs = self.vbatch_inputs.get((bp, n))
        if bufs is None:
            dev = self.kv.k_store.device
            bufs = self.vbatch_inputs[(bp, n)] = (
                self._zeros(bp * n), torch.zeros(2, bp, n, dtype=torch.long, device=dev),
                torch.zeros(bp, n, n, dtype=torch.bool, device=dev))
        return bufs

    def _vbatch_step(self, bp: int, n: int, kv_len: int) -> Outputs:
        x, idx, anc = self._vbatch_input(bp, n)
        step = StepInfo.batched_tree(idx[0], idx[1], anc, kv_len, self._tables(bp))
        taps: dict[int, torch.Tensor] = dict.fromkeys(self.taps)
        out = self.model(x, step, self.kv, 0, logit_rows=slice(0, bp * n), taps=taps)
        return out, taps

    def _vbatch_graph(self, bp: int, n: int, kv_len: int
                      ) -> tuple[torch.cuda.CUDAGraph, Outputs]:
        """The graph of a batched verify step, captured at its first need; the least recently
        replayed ones go past VBATCH_OUTPUT_BYTES of outputs held."""
        key = (bp, n, kv_len)
        entry = self.vbatch_graphs.get(key)
        if entry is None:
            entry = capture(lambda: self._vbatch_step(bp, n, kv_len), self.pool)
            log.debug("captured a batched verify graph of %d x %d rows for layers %d:%d, "
                      "%d keys", bp, n, self.model.start, self.model.end, kv_len)
        keep_recent(self.vbatch_graphs, key, entry, VBATCH_OUTPUT_BYTES,
                    lambda e: _output_bytes(e[1]))
        return entry

    def _load_vbatch_trees(self, bp: int, n: int, keys: tuple[tuple[int, ...], ...]) -> None:
        """The ancestors of each sequence's tree into the step's buffer (padding sequences:
        the first's), unless it holds them already (a draft's tree shape is fixed)."""
        keys = keys + (keys[0],) * (bp - len(keys))
        if self.vbatch_trees.get((bp, n)) == keys:
            return
        host = torch.stack([ancestors(k) for k in keys])
        anc = self._vbatch_input(bp, n)[2]
        anc.copy_(host.pin_memory() if anc.is_cuda else host, non_blocking=True)
        self.vbatch_trees[(bp, n)] = keys

    @torch.inference_mode()
    def run_verify_batch(self, x: torch.Tensor, slots: Sequence[int], positions: Sequence[int],
                         trees: Sequence[Sequence[int] | None]) -> Outputs:
        """The verify steps of len(slots) sequences as one step over a paged cache (one graph
        per padded batch, rows per sequence and KV-length bucket): sequence i has n rows,
        x[i * n:(i + 1) * n], at position `positions[i]` of slot `slots[i]`, a chain (None) or
        the token tree `trees[i]`, each exactly as `run` would take it alone. Returns the
        output rows (hidden, or float32 logits of every row on the last range) and the tapped
        layers' rows, sequence after sequence (new tensors)."""
        s = len(slots)
        n = x.shape[0] // max(s, 1)
        if not self.paged or self.per_slot or not s or n < 2 or x.shape[0] != s * n or \
                len(positions) != s or len(trees) != s or len(set(slots)) != s:
            raise ValueError(f"a batched verify step needs a paged cache and distinct slots of "
                             f"n > 1 rows each: {x.shape[0]} rows, slots {list(slots)}, "
                             f"positions {list(positions)}")
        for slot, pos in zip(slots, positions):
            if pos < 0 or pos + n > self.kv.capacity(slot):
                raise IndexError(f"rows {pos}..{pos + n} outside slot {slot}'s block table of "
                                 f"{self.kv.capacity(slot)} rows")
        bp = batch_bucket(s)
        keys = tuple(tuple(range(n - 1)) if t is None else tuple(t) for t in trees)
        if any(len(k) != n - 1 for k in keys):
            raise ValueError(f"a tree of each sequence's {n - 1} draft rows, got {keys}")
        buf, idx, _ = self._vbatch_input(bp, n)
        host = torch.full((2, bp, n), self.kv.scratch_pos, dtype=torch.long)
        for i, (pos, k) in enumerate(zip(positions, keys)):
            host[0, i] = torch.arange(pos, pos + n)
            host[1, i] = pos + torch.tensor(depths(k))
        idx.copy_(host.pin_memory() if idx.is_cuda else host, non_blocking=True)
        self._load_vbatch_trees(bp, n, keys)
        tables = self._tables(bp)
        tables.fill_(self.kv.num_blocks)
        tables[:s] = self.kv.table[to_device(list(slots), tables.device)]
        buf[:s * n].copy_(x.to(buf.device, buf.dtype).reshape(-1, *buf.shape[1:]))
        buf[s * n:].zero_()
        kv_len = self.kv_len(max(positions), n)
        if not self.capture:
            out, taps = self._vbatch_step(bp, n, kv_len)
        else:
            graph, (out, taps) = self._vbatch_graph(bp, n, kv_len)
            graph.replay()
        return out[:s * n].clone(), {k: v[:s * n].clone() for k, v in taps.items()}
