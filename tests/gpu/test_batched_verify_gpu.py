"""Batched verify steps on a GPU: the verify segments of several speculating
sequences as one captured step (`StaticDecoder.run_verify_batch`, the Triton decode kernel over
S sequences of n rows), against each sequence's verify step alone, with the kernels and with
the torch decode path; through `RangeExecutor.run_segments`, which groups them.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only; there `run_segments` does not batch, so the batched step
is called directly). Tolerances as `tests/gpu/test_decode_kernels.py`: a batched step's
projections take more rows than a sequence's alone, which a GPU's GEMMs may round differently.
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import GroupTaps, RangeExecutor, Segment, group_rows
from layersplit.shards.fused import fuse_projections
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.parked_rows import ParkedRows

from tests.gpu import near
from tests.gpu.test_decode_kernels import DEV, DTYPES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]

MAX_LEN, BLOCK, SLOTS = 256, 16, 4
LENS = (40, 57, 23, 70)
TAPS = (1, 4)


def _executor(path, dtype: torch.dtype, kernels: bool) -> RangeExecutor:
    model = load_layer_range(open_checkpoint(path), 0, 6, dtype, DEV)
    fuse_projections(model, compile=False, kernels=kernels)
    ex = RangeExecutor(model, MAX_LEN, SLOTS, device=DEV, static_decode=True, graph_bucket=32,
                       taps=TAPS, paged=(SLOTS * 16 + 3, BLOCK))
    order = torch.randperm(SLOTS * 16 + 3, generator=torch.Generator().manual_seed(2)).tolist()
    for s in range(SLOTS):
        ex.kv.set_table(s, 0, order[s * 16:(s + 1) * 16])
    return ex


CASES = [(f, torch.float32) for f in ("llama", "qwen3", "qwen3_moe")] + \
    [(f, torch.bfloat16) for f in ("llama", "qwen3") if torch.bfloat16 in DTYPES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("family,dtype", CASES, ids=str)
def test_batched_verify_equals_each_alone(tiny_models, family, dtype):
    """float32: within 1e-4. bf16 (dense families: an MoE's router may pick other experts for
    a row whose scores round differently): within twice the bf16 step's own distance from the
    float32 one, at least 0.05, as `tests/gpu/test_decode_kernels.py`."""
    path = tiny_models[family]
    runs = {"alone": _executor(path, dtype, True), "kernels": _executor(path, dtype, True),
            "torch": _executor(path, dtype, False)}
    if dtype != torch.float32:
        runs["fp32"] = _executor(path, torch.float32, True)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for ex in runs.values():
        for slot, n in enumerate(LENS):
            ex.run(torch.arange(3, 3 + n), 0, slot)
    assert runs["kernels"].model.layers[0].fast.kernels
    trees = [None, [0, 0, 1, 1], [0, 1, 2, 2]]  # a chain and two trees of 5 rows
    for rnd in range(3):  # the same graphs at other positions, and across a KV bucket
        slots = [0, 2, 3] if rnd != 1 else [3, 1]
        positions = [LENS[s] + 5 * rnd for s in slots]
        tr = trees[:len(slots)]
        x = torch.randint(3, 60, (5 * len(slots),),
                          generator=torch.Generator().manual_seed(rnd))
        spare = min({0, 1, 2, 3} - set(slots))  # a decode beside them (on CUDA)
        want, want_taps, bound = [], [], []
        for i, (s, p, t) in enumerate(zip(slots, positions, tr)):
            taps: dict = {}
            want.append(runs["alone"].run(x[5 * i:5 * i + 5], p, s, all_logits=True, taps=taps,
                                          verify=True, tree=t).clone())
            want_taps.append({k: v.clone() for k, v in taps.items()})
            if "fp32" in runs:
                ref = runs["fp32"].run(x[5 * i:5 * i + 5], p, s, all_logits=True, verify=True,
                                       tree=t)
                bound.append(max(tol, 2 * _rel(want[-1], ref)))
            else:
                bound.append(tol)
        for name in ("kernels", "torch"):
            ex = runs[name]
            if ex.device.type == "cuda":  # through the executor's grouping, a decode beside
                segs = [Segment(s, p, 5, verify=True, tree=t, all_logits=True, taps={})
                        for s, p, t in zip(slots, positions, tr)]
                segs.insert(1, Segment(spare, LENS[spare] + rnd, 1))
                xs = torch.cat([x[:5], torch.tensor([7]), x[5:]])
                outs = ex.run_segments(xs.to(DEV), segs)
                del outs[1], segs[1]
                got_taps = [s.taps for s in segs]
                assert ex.static.vbatch_graphs  # (they ran as one batched graph)
            else:
                out, tapped = ex.static.run_verify_batch(x, slots, positions, tr)
                outs = [out[5 * i:5 * i + 5] for i in range(len(slots))]
                got_taps = [{k: v[5 * i:5 * i + 5] for k, v in tapped.items()}
                            for i in range(len(slots))]
            for i in range(len(slots)):
                assert near(outs[i], want[i], bound[i]), (name, rnd, i, _rel(outs[i], want[i]))
                assert set(got_taps[i]) == set(TAPS)
                for layer in TAPS:
                    assert near(got_taps[i][layer], want_taps[i][layer], bound[i]), \
                        (name, rnd, layer)
        if runs["alone"].device.type == "cuda":  # the spare slot's decode row, alone too
            for name in ("alone", "fp32"):
                if name in runs:
                    runs[name].run(torch.tensor([7]), LENS[spare] + rnd, spare)
        for s, p in zip(slots, positions):  # the rows each wrote, through the tables
            rows = list(range(p + 5))
            ref = runs["alone"].kv.get_rows(s, rows)
            for name in ("kernels", "torch"):
                got = runs[name].kv.get_rows(s, rows)
                assert near(got[0], ref[0], 1e-3 if dtype == torch.float32 else 0.1), (name, s)
    assert runs["kernels"].model.layers[0].fast.kernels  # (no fallback in any step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="run_segments batches on CUDA only")
def test_batched_decode_feeding_the_draft_parks_the_groups_rows_by_one_copy(tiny_models):
    """Decode segments that feed the draft, batched by `run_segments`: each reads its row of the
    group's tapped rows (`GroupTaps`), as its own decode step computes them, and the shard's
    parking takes the group's rows whole (`group_rows`): the rows parked by that one copy equal
    those parked a segment at a time."""
    ex = _executor(tiny_models["qwen3"], torch.float32, True)
    alone = _executor(tiny_models["qwen3"], torch.float32, True)
    for e in (ex, alone):
        for slot, n in enumerate(LENS):
            e.run(torch.arange(3, 3 + n), 0, slot)
    slots = [2, 0, 3]
    x = torch.tensor([11, 12, 13])
    segs = [Segment(s, LENS[s], 1, taps={}, feed=s) for s in slots]
    ex.run_segments(x.to(DEV), segs)
    assert all(isinstance(s.taps, GroupTaps) for s in segs)
    group = group_rows([s.taps for s in segs])
    assert group is not None and sorted(group) == list(TAPS)
    one, each = ParkedRows(), ParkedRows()
    one.add_step(1, [(s.feed, s.pos, 1) for s in segs], [group[t] for t in TAPS])
    for i, s in enumerate(segs):
        each.add(1, s.feed, s.pos, [s.taps[t] for t in TAPS])
        want: dict = {}
        alone.run(x[i:i + 1], s.pos, s.slot, taps=want)
        for layer in TAPS:
            assert near(s.taps[layer], want[layer], 1e-4), (i, layer)
    got, ref = one.take(), each.take()
    assert [(r.context, r.pos, r.end) for r in got] == [(r.context, r.pos, r.end) for r in ref]
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(torch.cat(g.rows), torch.cat(r.rows))
