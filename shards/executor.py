"""Runs one layer range for one step: the compute half of a shard, with no IPC in it.

The reference engine runs the whole model through one executor; a shard process runs its
range through one, so both take exactly the same arithmetic path.

Three kinds of step: a prefill chunk (eager, many rows), a decode step (one row; a CUDA graph on
GPUs), and a speculative verify step (the last token and the draft tokens). On GPUs a verify step
is one batched graph. On the CPU it runs row by row, each row exactly as a decode step would
run it: a batched matmul need not round like a one-row one, and speculative greedy output must
equal plain greedy output token for token.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence

import torch
from layersplit.shards.device import to_device
from layersplit.shards.errors import CheckpointError
from layersplit.shards.fused import FusedDecode, prefill_kernels_take
from layersplit.shards.graphs import CaptureFailed, StaticDecoder
from layersplit.shards.hybrid_cache import HybridState
from layersplit.shards.kernels.gated_delta_fla import describe as describe_delta_rules
from layersplit.shards.kv_cache import KVCache, KVLayout
from layersplit.shards.layers.step import SegmentsRefused, StepInfo
from layersplit.shards.model_config import context_limit_error
from layersplit.shards.models import LayerRange
from layersplit.shards.paged_kv import PagedKVCache
from layersplit.shards.prefill_graphs import PrefillGraphs, refusal
from layersplit.shards.sampling import sample_rows
from layersplit.shards.spec_tree import depths, is_chain, kept_moves

log = logging.getLogger(__name__)

MAX_VERIFY_ROWS = 64  # a verify step longer than this (a huge draft tree) runs eagerly


@dataclasses.dataclass(slots=True)
class Segment:
    """One sequence's rows in a batched step: `n` rows at positions [pos, pos + n) of `slot`."""

    slot: int
    pos: int
    n: int
    verify: bool = False  # a speculative verify segment (last token + draft tokens)
    tree: list[int] | None = None  # a verify segment's token tree (`shards.spec_tree`); None: chain
    all_logits: bool = False  # logits of every row (else of the last), on the last range
    taps: dict[int, torch.Tensor] | GroupTaps | None = None  # filled with the tapped layers'
    # rows (a batched decode step's: its row of the group's, `GroupTaps`)
    feed: int | None = None  # the sequence's draft context, when the rows go to the draft


class GroupTaps(Mapping):
    """A segment's tapped rows in a batched decode step: row `row` of each of the group's
    (`rows`, global layer -> (the group's rows, hidden), in the group's order), sliced when
    read. A shard that parks the whole group's rows takes them from `rows` at once
    (`group_rows`): no slice a sequence, no gathering them again."""

    __slots__ = ("rows", "row")

    def __init__(self, rows: dict[int, torch.Tensor], row: int) -> None:
        self.rows, self.row = rows, row

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.rows[layer][self.row:self.row + 1]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def group_rows(taps: Sequence[Mapping[int, torch.Tensor] | None]) -> dict[int, torch.Tensor] | None:
    """The group's tapped rows (`GroupTaps.rows`) when `taps` are those of every segment of
    one batched decode step, in its order; else None."""
    first = taps[0] if taps else None
    if not isinstance(first, GroupTaps):
        return None
    rows = first.rows
    some = next(iter(rows.values()), None)
    if some is None or len(taps) != some.shape[0]:
        return None
    for j, t in enumerate(taps):
        if not isinstance(t, GroupTaps) or t.rows is not rows or t.row != j:
            return None
    return rows


class RangeExecutor:
    def __init__(
        self, model: LayerRange, max_len: int, slots: int = 1, device: torch.device | str = "cpu",
        static_decode: bool | None = None, graph_bucket: int = 256, taps: tuple[int, ...] = (),
        paged: tuple[int, int] | None = None,
    ) -> None:
        """`paged`: (blocks, block tokens): a paged KV pool (`shards.paged_kv`, a shard's),
        whose slots' block tables the coordinator fills; None: a contiguous slot of `max_len`
        rows per sequence (the reference engine's)."""
        self.model = model
        self.device = torch.device(device)
        cfg = model.cfg
        if (why := context_limit_error(cfg, max_len)) is not None:
            raise CheckpointError(why)
        self.dtype = next(model.parameters()).dtype
        new_cache = getattr(model, "new_cache", None)  # a hybrid model's KV + state
        self.hybrid = new_cache is not None
        self.paged = paged
        if self.hybrid:
            extra = {} if paged is None else {"paged": paged}
            self.kv: KVCache | PagedKVCache = new_cache(max_len, slots, self.device, self.dtype,
                                                        **extra)
            self.layout = self.kv.layout
            if getattr(model, "linear_layers", None):
                log.info("layers %d:%d: gated delta rule on %s: %s", model.start, model.end,
                         self.device, describe_delta_rules(self.device))
        else:
            self.layout = KVLayout(model.num_layers, *cfg.kv_row, self.dtype)
            self.kv = (KVCache(self.layout, max_len, slots, self.device) if paged is None else
                       PagedKVCache(self.layout, max_len, slots, *paged, self.device))
        self.taps = tuple(t for t in taps if model.start <= t < model.end)
        if static_decode is None:  # CUDA graphs on GPUs; the plain eager path on CPU
            static_decode = self.device.type == "cuda"
        # a hybrid model captures its one-token decode steps (a graph per slot: the recurrent
        # states are the slot's) and its batched decode steps (each row's state slot an
        # input); its verify steps keep each row's state until the next step settles it
        self.static = (StaticDecoder(model, self.kv, graph_bucket, self.taps,
                                     per_slot=self.hybrid) if static_decode else None)
        # batch- and verify-invariant steps (`deterministic = true`): see `rowwise_verify`
        self.deterministic = False
        # a hybrid range's chain verify steps as one step of all their rows (a graph per
        # slot, bucket and rows where decode steps are captured, else `_hybrid_chain`), on GPUs:
        # row by row each row is a whole eager pass through the range (~50 ms a row on the
        # Qwen3.5-27B shape, 2026-11-30)
        self.hybrid_chain_verify = self.hybrid and self.device.type == "cuda"
        self.hybrid_verify_graphs = True  # (off after a failed capture or replay: eager then)
        # the verify segments of several sequences run as one batched step (`run_segments`):
        # over a paged cache, without sliding-window layers (a tree row's key position in a
        # window is computed for one sequence's step only)
        self.batch_verify = paged is not None and not self.hybrid and all(
            cfg.window(i) is None for i in range(model.start, model.end))
        # the decode rows of several sequences run as one batched step (`run_segments`), a
        # hybrid range's too (each row's state slot a graph input, `StepInfo.states`)
        self.batch_decode = True
        # the eager prefill segments of several sequences run as one step (`run_segments`):
        # on GPUs, where the row kernels' eager path attends sequence by sequence
        self.batch_prefill = self.device.type == "cuda"
        # one sequence's eager steps as piecewise CUDA graphs (a small dense range's)
        self.prefill_graphs: PrefillGraphs | None = None
        if self.static is not None and self.device.type == "cuda" and not self.hybrid:
            why = refusal(model, self.kv)
            if why is None:
                self.prefill_graphs = PrefillGraphs(model, self.kv, max_len)
            log.info("layers %d:%d: prefill graphs %s", model.start, model.end,
                     "on" if why is None else f"off ({why})")

    @property
    def rowwise_verify(self) -> bool:
        """Whether verify steps run row by row, each row a decode step: on the CPU (bit for bit
        a plain decode step), on a hybrid range (each row's state kept; on GPUs a chain's rows
        run as one step instead, `hybrid_chain_verify`), and in deterministic mode, where each
        row takes the very one-row step (captured graph) a plain decode step takes, so
        speculation cannot change a token on a GPU either."""
        return self.device.type != "cuda" or self.hybrid or self.deterministic

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def before_step(self, slot: int, pos: int, kept: Sequence[int] | None) -> None:
        """What a sequence's step at `pos` needs first after a verify step: the K/V of the
        tree rows it kept (`kept`) moved into place, and on a hybrid model the state of the
        last row it kept made the live state."""
        self.before_steps([(slot, pos, kept)])

    def before_steps(self, seqs: Sequence[tuple[int, int, Sequence[int] | None]]) -> None:
        """`before_step` of each (slot, pos, kept) of a step's sequences, the kept rows of all
        of them moved by one copy (`move_rows_many`)."""
        self.kv.move_rows_many([(slot, *kept_moves(pos, kept)) for slot, pos, kept in seqs
                                if kept])
        if isinstance(self.kv, HybridState):
            for slot, pos, kept in seqs:
                self.kv.settle(slot, pos, list(kept) if kept else None)

    @torch.inference_mode()
    def run(
        self,
        x: torch.Tensor,
        pos: int,
        slot: int = 0,
        all_logits: bool = False,
        taps: dict[int, torch.Tensor] | None = None,
        verify: bool = False,
        tree: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states (n, hidden) out of this range, or logits on the last range (of the last
        row, or of every row with `all_logits`). With `taps` (a dict), the rows of this range's
        tapped layers are stored in it by global layer index. A verify step's rows are a chain,
        or the token tree `tree` (parents, `shards.spec_tree`). On CUDA a static step's output is
        its graph's buffer (`StaticDecoder.run`), valid until the next static step: copy it
        to keep it."""
        n = x.shape[0]
        if pos + n > self.kv.max_len:
            raise ValueError(
                f"positions {pos}..{pos + n} exceed the context of {self.kv.max_len} tokens"
            )
        if self.static is not None and self._static_step(n, pos, verify, is_chain(tree)):
            if self.hybrid and verify:
                return self._hybrid_chain_graph(x, pos, slot, all_logits, taps)
            out, rows = self.static.run(x, pos, slot, tree if verify else None)
            if taps is not None:
                taps.update(rows)
            return out if all_logits or not self.model.is_last else out[-1:]
        if verify and self.rowwise_verify:
            if self.hybrid_chain_verify and not self.deterministic and is_chain(tree) and n > 1:
                return self._hybrid_chain(x, pos, slot, all_logits, taps)
            return self._rowwise(x, pos, slot, all_logits, taps, tree)
        rows = None if all_logits else slice(n - 1, n)
        want = None if taps is None else dict.fromkeys(self.taps)
        graphs = self.prefill_graphs
        out = None
        if graphs is not None and not verify and not self.deterministic and graphs.takes(n):
            out = graphs.run(self.model.embed(x.to(self.device)), pos, slot, want)
            if out is not None and self.model.is_last:
                out = self.model.logits(out, rows)
        if out is None:
            step = StepInfo.tree(pos, tree, self.device) if verify and not is_chain(tree) \
                else pos
            out = self.model(x.to(self.device), step, self.kv, slot, logit_rows=rows, taps=want)
        if taps is not None:
            taps.update(want)
        return out

    def run_segments(self, x: torch.Tensor, segs: list[Segment]) -> list[torch.Tensor]:
        """Run a batched step: `x` holds the segments' rows one after the other; returns each
        segment's output as `run` would (hidden rows, or logits).

        On GPUs the one-row decode segments of several sequences run as one batched step (one
        CUDA graph), so do the verify segments of as many rows of several sequences
        (`StaticDecoder.run_verify_batch`, over a paged cache), and so do the prefill
        segments where the row kernels run every layer (`_prefill_batched`): there a bf16
        GEMM over more rows may round a row otherwise. Every other segment, everything in
        deterministic mode and everything on the CPU runs on its own, exactly as it would
        alone, so a sequence's output never depends on what it was batched with there (a CPU
        matmul over more rows need not round each row as a one-row matmul does)."""
        starts = [0]
        for s in segs:
            starts.append(starts[-1] + s.n)
        outs: list[torch.Tensor | None] = [None] * len(segs)
        if self.static is not None and self.device.type == "cuda" and self.batch_decode and \
                not self.deterministic:  # (deterministic: each sequence's step alone)
            # (a hybrid range's rows past position 0: the first step of a sequence resets its
            # states on the host)
            group = [i for i, s in enumerate(segs)
                     if s.n == 1 and not s.verify and (not self.hybrid or s.pos > 0)]
            if self.hybrid and ("batch" in self.static.failed or not self.model.graph_safe(
                    self.static.batch_rows([segs[i].slot for i in group]))):
                group = []  # (its capture failed, or its experts would sync the host in it)
            if len(group) >= 2:  # (those that feed the draft too: the graph taps its rows)
                rows = torch.cat([x[starts[i]:starts[i] + 1] for i in group])
                tapped = {} if any(segs[i].taps is not None for i in group) else None
                out = self._run_batch(rows, [segs[i] for i in group], tapped)
                for j, i in enumerate(group if out is not None else ()):
                    outs[i] = out[j:j + 1]
                    if segs[i].taps is not None:
                        segs[i].taps = GroupTaps(tapped, j)
            if self.batch_verify:
                self._verify_batched(x, segs, starts, outs)
        if self.batch_prefill and self._prefill_batchable():
            self._prefill_batched(x, segs, starts, outs)
        alone = sum(o is None for o in outs) == 1
        for i, s in enumerate(segs):
            if outs[i] is None:
                outs[i] = self.run(x[starts[i]:starts[i + 1]], s.pos, s.slot,
                                   all_logits=s.all_logits, taps=s.taps, verify=s.verify,
                                   tree=s.tree)
                if self.static is not None and not alone:
                    # a graph's outputs are static buffers that the next graph's replay may
                    # overwrite (captures share one memory pool): keep copies
                    outs[i] = outs[i].clone()
                    if s.taps:
                        s.taps.update({k: v.clone() for k, v in s.taps.items()})
        return outs

    def _run_batch(self, rows: torch.Tensor, segs: list[Segment],
                   tapped: dict[int, torch.Tensor] | None) -> torch.Tensor | None:
        """The decode rows of `segs` as one batched step (`StaticDecoder.run_batch`); None
        where a hybrid range's batched graph failed to capture (logged; its warm-up runs
        advanced only the scratch states, and the KV rows they wrote are rewritten), so each
        sequence runs alone, from then on. A failure after the capture is raised: the rows'
        states may have advanced, and running them again would advance them twice."""
        try:
            return self.static.run_batch(rows.to(self.device), [s.slot for s in segs],
                                         [s.pos for s in segs], tapped)
        except CaptureFailed as e:
            log.warning("layers %d:%d: a hybrid batched decode graph failed to capture (%s); "
                        "each sequence's decode step runs alone from now on", self.model.start,
                        self.model.end, e)
            self.batch_decode = False
            return None

    def _prefill_batchable(self) -> bool:
        """Whether eager segments may run as one step (`_prefill_batched`): every layer of the
        range on the row kernels' eager path (`FusedDecode.prefill`), which attends sequence
        by sequence; not in deterministic mode (each sequence's step alone)."""
        return not self.hybrid and not self.deterministic and all(
            isinstance(getattr(layer, "fast", None), FusedDecode) and
            layer.fast.prefill_kernels and layer.fast.kernels is not False
            for layer in self.model.layers)

    @torch.inference_mode()
    def _prefill_batched(self, x: torch.Tensor, segs: list[Segment], starts: list[int],
                         outs: list[torch.Tensor | None]) -> None:
        """The eager prefill segments of a step (several sequences' chunks) as one forward:
        norms, projections, rotary and MLP over all their rows at once, attention and the KV
        rows sequence by sequence (`StepInfo.segments`); a few launches a layer per sequence
        where each alone takes ~14. Outputs (and tapped rows) go where `run` would put each
        segment's. A layer that refuses the step (a kernel failed, so its torch layer runs)
        leaves the segments to run alone, rewriting the same KV rows, and this path off once
        the range is no longer all on the kernels (`_prefill_batchable`)."""
        group = [i for i, s in enumerate(segs)
                 if outs[i] is None and not s.verify and not self._static_step(s.n, s.pos, False)
                 and s.pos + s.n <= self.kv.max_len]
        if len(group) < 2 or not prefill_kernels_take(sum(segs[i].n for i in group),
                                                      self.model.cfg.hidden_size):
            return  # (the layers would refuse it)
        rows, a = [], 0  # the logit rows of each segment, in the step's rows
        for i in group:
            s = segs[i]
            rows += range(a, a + s.n) if s.all_logits else [a + s.n - 1]
            a += s.n
        xs = torch.cat([x[starts[i]:starts[i + 1]] for i in group]).to(self.device)
        step = StepInfo.segments([(segs[i].slot, segs[i].pos, segs[i].n) for i in group],
                                 self.device)
        want = dict.fromkeys(self.taps) if any(segs[i].taps is not None for i in group) else None
        try:
            out = self.model(xs, step, self.kv, 0, taps=want,
                             logit_rows=to_device(rows, self.device) if self.model.is_last
                             else None)
        except (ValueError, IndexError) as e:  # a bad segment: alone, it fails by name
            log.debug("layers %d:%d: a batched prefill step failed (%s); its segments run "
                      "alone", self.model.start, self.model.end, e)
            return
        except SegmentsRefused as e:  # a kernel failed: its layer runs the torch path
            self.batch_prefill = self._prefill_batchable()
            log.warning("layers %d:%d: a batched prefill step was refused (%s); its segments "
                        "run alone%s", self.model.start, self.model.end, e,
                        "" if self.batch_prefill else ", and from now on every step's")
            return
        a = b = 0
        for i in group:
            s = segs[i]
            n_out = s.n if s.all_logits or not self.model.is_last else 1
            outs[i] = out[b:b + n_out]
            if s.taps is not None:
                s.taps.update({k: v[a:a + s.n] for k, v in want.items()})
            a, b = a + s.n, b + n_out

    def verify_groups(self, segs: Sequence[Segment]) -> list[list[int]]:
        """The verify segments that run as one batched step: those of as many rows (2 up to
        MAX_VERIFY_ROWS), two or more of them, grouped by that number."""
        by_rows: dict[int, list[int]] = {}
        for i, s in enumerate(segs):
            if s.verify and 1 < s.n <= MAX_VERIFY_ROWS:
                by_rows.setdefault(s.n, []).append(i)
        return [group for group in by_rows.values() if len(group) >= 2]

    def _verify_batched(self, x: torch.Tensor, segs: list[Segment], starts: list[int],
                        outs: list[torch.Tensor | None]) -> None:
        """Run each group of `verify_groups` as one batched verify step; its outputs (and
        tapped rows) go where `run` would put each segment's."""
        for group in self.verify_groups(segs):
            n = segs[group[0]].n
            rows = torch.cat([x[starts[i]:starts[i + 1]] for i in group])
            try:
                out, tapped = self.static.run_verify_batch(
                    rows.to(self.device), [segs[i].slot for i in group],
                    [segs[i].pos for i in group], [segs[i].tree for i in group])
            except (ValueError, IndexError):  # a bad segment: alone, it fails by name
                return
            except Exception as e:  # noqa: BLE001 - each runs alone then (rewriting its rows)
                log.warning("layers %d:%d: a batched verify step failed (%s: %s); verify steps "
                            "run one by one from now on", self.model.start, self.model.end,
                            type(e).__name__, e)
                self.batch_verify = False
                return
            for j, i in enumerate(group):
                s = segs[i]
                o = out[j * n:(j + 1) * n]
                outs[i] = o if s.all_logits or not self.model.is_last else o[-1:]
                if s.taps is not None:
                    s.taps.update({k: v[j * n:(j + 1) * n] for k, v in tapped.items()})

    def _static_step(self, n: int, pos: int, verify: bool, chain: bool = True) -> bool:
        """Whether a step of n rows at `pos` runs as a static (captured) step: decode steps,
        and verify steps of up to MAX_VERIFY_ROWS rows; on a hybrid range decode steps past
        position 0 (the first resets the slot's states on the host) and, where
        `hybrid_chain_verify`, chain verify steps (each row's states kept)."""
        if self.hybrid:
            if verify:
                return self.hybrid_chain_verify and self.hybrid_verify_graphs and \
                    "verify" not in self.static.failed and not self.deterministic and chain \
                    and 1 < n <= MAX_VERIFY_ROWS and pos > 0 and self.model.graph_safe(n)
            return n == 1 and pos > 0
        if self.deterministic and verify and n > 1:
            return False  # row by row (`_rowwise`), each row the one-row graph
        return n == 1 or (verify and n <= MAX_VERIFY_ROWS)

    def _rowwise(self, x: torch.Tensor, pos: int, slot: int, all_logits: bool,
                 taps: dict[int, torch.Tensor] | None,
                 tree: Sequence[int] | None = None) -> torch.Tensor:
        """A verify step as len(x) decode steps, each bit-identical to a plain decode step.

        A tree's rows run in their (depth-first) order, row j as the decode step at position
        pos + depth(j): the rows below it then hold exactly its ancestors (a sibling's subtree
        written there before is done). Each row's K/V are set aside and laid at row pos + j at
        the end, where a graph's tree step leaves them (`shards.spec_tree`)."""
        chain = is_chain(tree)
        depth = list(range(x.shape[0])) if chain else depths(tree)
        outs, tapped, kept = [], [], []
        hybrid = self.kv if isinstance(self.kv, HybridState) else None
        states = []  # a hybrid model's state after each row
        # deterministic mode: each row through the one-row step a plain decode step takes (its
        # captured graph on a GPU; a hybrid range's per-slot graph, which advances the slot's
        # states in place, as its eager step does, from position 1 on, as plain decoding);
        # its outputs are the graph's buffers, hence the copies
        one_row = self.static if self.deterministic else None
        for j, d in enumerate(depth):
            want = None if taps is None else dict.fromkeys(self.taps)
            if hybrid is not None and not chain and j > 0 and tree[j - 1] != j - 1:
                hybrid.load(slot, states[tree[j - 1]])  # row j follows its parent's state
            if one_row is not None and (hybrid is None or pos + d > 0):
                out, rows = one_row.run(x[j:j + 1].to(self.device), pos + d, slot)
                outs.append(out.clone())
                want = None if taps is None else {k: v.clone() for k, v in rows.items()}
            else:
                outs.append(self.model(x[j:j + 1].to(self.device), pos + d, self.kv, slot,
                                       logit_rows=slice(0, 1), taps=want))
            tapped.append(want)
            if hybrid is not None:
                states.append(hybrid.save(slot))
            if not chain:
                kept.append(self.kv.get_rows(slot, [pos + d]))
        for j, (k, v) in enumerate(kept):
            self.kv.set_rows(slot, [pos + j], k, v)
        if hybrid is not None:
            hybrid.keep_rows(slot, pos, states)
        if taps is not None:
            taps.update({layer: torch.cat([t[layer] for t in tapped]) for layer in self.taps})
        out = torch.cat(outs)
        return out if all_logits or not self.model.is_last else out[-1:]

    def _hybrid_chain_graph(self, x: torch.Tensor, pos: int, slot: int, all_logits: bool,
                            taps: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """`_hybrid_chain` as a captured step (`StaticDecoder`: a graph per slot, KV bucket and
        rows), its rows' states kept in the decoder's shared keep buffers; a failed capture or
        replay is logged and the eager step runs, from then on."""
        n = x.shape[0]
        try:
            conv, state = self.static.keep_buffers(n)
            self.kv.own_kept_rows(state, slot)  # (the replay overwrites the shared buffers)
            out, rows = self.static.run(x, pos, slot, None)
        except (ValueError, IndexError):
            raise  # (a bad step: named, and the graphs stay on)
        except Exception as e:  # noqa: BLE001 - a capture or replay failure: the eager step
            log.warning("layers %d:%d: a hybrid verify graph failed (%s: %s); chain verify "
                        "steps run eager from now on", self.model.start, self.model.end,
                        type(e).__name__, e)
            self.hybrid_verify_graphs = False
            return self._hybrid_chain(x, pos, slot, all_logits, taps)
        self.kv.keep_pair(slot, pos, (conv, state))
        if taps is not None:
            taps.update(rows)
        return out if all_logits or not self.model.is_last else out[-1:]

    def _hybrid_chain(self, x: torch.Tensor, pos: int, slot: int, all_logits: bool,
                      taps: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """A hybrid range's verify step of a chain as one eager step of its n rows: the K/V
        rows written at pos .. pos + n - 1 as `_rowwise` leaves them, the linear layers' conv
        and recurrent state after each row kept (`HybridRange.new_keep`) until the next step
        settles on the last accepted row's; the slot's live states are left as they were. Each
        row's output equals its row-by-row output up to rounding (a GEMM over n rows)."""
        n = x.shape[0]
        keep = self.model.new_keep(self.kv, n)
        want = None if taps is None else dict.fromkeys(self.taps)
        out = self.model(x.to(self.device), pos, self.kv, slot,
                         logit_rows=None if all_logits else slice(n - 1, n), taps=want,
                         keep=keep)
        self.kv.keep_pair(slot, pos, keep)
        if taps is not None:
            taps.update(want)
        return out

    def sample(self, logits: torch.Tensor, sample: dict, position: int) -> int:
        """Sample the token for `position` from one row of logits."""
        return sample_rows(
            logits[-1:], sample["temperature"], sample["top_k"], sample["top_p"],
            sample["seed"], [position],
        )[0]
