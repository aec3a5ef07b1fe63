"""The verify steps of several speculating sequences as one batched step
(`StaticDecoder.run_verify_batch`, `StepInfo.batched_tree`) against each sequence's verify step
alone (`StaticDecoder.run`), on the CPU, where the static step runs without capture: the same
step a GPU captures (the GPU test, `tests/gpu/test_batched_verify_gpu.py`, runs the graphs and
the Triton kernel). float32; the batched step's matmuls take more rows, which may round
differently, so outputs agree within 1e-4 of their magnitude (a row that saw another
sequence's keys, a wrong ancestor or position, is off by far more)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.layers.step import StepInfo

from tests.helpers import close_rel, step_rows

MAX_LEN, BLOCK, BLOCKS, SLOTS = 64, 8, 40, 4
LENS = (13, 21, 5, 9)  # prompt per slot
TAPS = (1, 4)


def _executor(path, start: int, end: int) -> RangeExecutor:
    ex = RangeExecutor(load_layer_range(open_checkpoint(path), start, end), MAX_LEN, SLOTS,
                       static_decode=True, graph_bucket=16, taps=TAPS, paged=(BLOCKS, BLOCK))
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    for slot in range(SLOTS):  # 8 blocks = 64 rows each, interleaved across the pool
        ex.kv.set_table(slot, 0, order[slot::5][:8])
    return ex


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("layers", [(0, 6), (2, 5), (3, 6)], ids=["whole", "middle", "last"])
def test_batched_verify_equals_each_verify_alone(tiny_models, family, layers):
    path = tiny_models[family]
    solo, batched = _executor(path, *layers), _executor(path, *layers)
    assert batched.batch_verify
    for ex in (solo, batched):
        for slot, n in enumerate(LENS):
            ex.run(step_rows(ex.model, n, seed=slot), 0, slot)
    # three sequences of 4 rows (a chain and two trees; slot 3 stays out): padded to a batch
    # of 4, whose padding sequence writes only the scratch block
    slots, trees = [2, 0, 1], [None, [0, 0, 1], [0, 1, 1]]
    positions = [LENS[s] for s in slots]
    xs = [step_rows(solo.model, 4, seed=10 + i) for i in range(3)]
    want = [solo.static.run(x, p, s, t) for x, p, s, t in zip(xs, positions, slots, trees)]
    want = [(o.clone(), {k: v.clone() for k, v in taps.items()}) for o, taps in want]
    idle = batched.kv.get_rows(3, list(range(LENS[3])))
    out, taps = batched.static.run_verify_batch(torch.cat(xs), slots, positions, trees)
    assert out.shape[0] == 12 and set(taps) == {t for t in TAPS if layers[0] <= t < layers[1]}
    for i, (o, tapped) in enumerate(want):
        assert close_rel(out[4 * i:4 * i + 4], o), (family, i)
        for layer, rows in tapped.items():
            assert close_rel(taps[layer][4 * i:4 * i + 4], rows), (family, i, layer)
    for slot, pos in zip(slots, positions):  # the same K/V rows written, none elsewhere
        got, ref = batched.kv.get_rows(slot, list(range(pos + 4))), \
            solo.kv.get_rows(slot, list(range(pos + 4)))
        assert close_rel(got[0], ref[0]) and close_rel(got[1], ref[1])
    after = batched.kv.get_rows(3, list(range(LENS[3])))
    assert torch.equal(after[0], idle[0]) and torch.equal(after[1], idle[1])
    # through the executor's grouping: two of the same rows make a group, a lone size not
    from layersplit.shards.executor import Segment

    segs = [Segment(0, 20, 4, verify=True), Segment(1, 30, 1), Segment(2, 9, 4, verify=True),
            Segment(3, 12, 3, verify=True)]
    assert batched.verify_groups(segs) == [[0, 2]]


def test_a_second_batch_reuses_the_buffers_and_positions_move(tiny_models):
    """The static buffers hold the last batch's trees and rows: a second batch at other
    positions, with other trees, in other slots, is still each sequence's own verify step."""
    path = tiny_models["llama"]
    solo, batched = _executor(path, 0, 6), _executor(path, 0, 6)
    for ex in (solo, batched):
        for slot, n in enumerate(LENS):
            ex.run(step_rows(ex.model, n, seed=slot), 0, slot)
    for rnd, (slots, trees) in enumerate([([0, 1], [[0, 0], [0, 1]]),
                                          ([3, 1, 0], [[0, 1], None, [0, 0]])]):
        positions = [LENS[s] + 3 * rnd for s in slots]
        xs = [step_rows(solo.model, 3, seed=20 * rnd + i) for i in range(len(slots))]
        want = [solo.static.run(x, p, s, t)[0].clone()
                for x, p, s, t in zip(xs, positions, slots, trees)]
        out, _ = batched.static.run_verify_batch(torch.cat(xs), slots, positions, trees)
        for i, o in enumerate(want):
            assert close_rel(out[3 * i:3 * i + 3], o), (rnd, i)


def test_batched_verify_refuses_what_it_does_not_run(tiny_models):
    """Sliding-window layers: the executor never batches their verify steps, and the step's
    mask refuses a window by name; bad shapes, repeated slots and rows past a table are
    refused."""
    windowed = _executor(tiny_models["mistral-window"], 0, 6)
    assert not windowed.batch_verify
    step = StepInfo.batched_tree(torch.zeros(2, 3, dtype=torch.long),
                                 torch.zeros(2, 3, dtype=torch.long),
                                 torch.ones(2, 3, 3, dtype=torch.bool), 16,
                                 torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="sliding-window"):
        step.mask_for(4)
    ex = _executor(tiny_models["llama"], 0, 6)
    x = step_rows(ex.model, 6, seed=1)
    with pytest.raises(ValueError, match="distinct slots"):
        ex.static.run_verify_batch(x, [1, 1], [3, 4], [None, None])
    with pytest.raises(ValueError, match="distinct slots"):
        ex.static.run_verify_batch(x[:5], [1, 2], [3, 4], [None, None])
    with pytest.raises(ValueError, match="tree"):
        ex.static.run_verify_batch(x, [1, 2], [3, 4], [None, [0, 0, 0]])
    with pytest.raises(IndexError, match="block table"):
        ex.static.run_verify_batch(x, [1, 2], [3, MAX_LEN - 2], [None, None])


def test_the_executor_maps_a_batched_step_back_to_its_segments(tiny_models, monkeypatch):
    """`RangeExecutor._verify_batched` (what `run_segments` runs on a GPU): each verify
    segment's output (every row's logits on the last range, the hidden rows elsewhere) and
    tapped rows are its own, as alone; a batched step that fails leaves the segments to run
    alone (a bad one fails there by name), and a failure of the step itself turns batching
    off."""
    from layersplit.shards.executor import Segment

    path = tiny_models["llama"]
    for layers in ((0, 6), (0, 3)):
        solo, batched = _executor(path, *layers), _executor(path, *layers)
        for ex in (solo, batched):
            for slot, n in enumerate(LENS):
                ex.run(step_rows(ex.model, n, seed=slot), 0, slot)
        segs = [Segment(1, LENS[1], 3, verify=True, tree=[0, 0], all_logits=True, taps={}),
                Segment(3, LENS[3], 1),
                Segment(0, LENS[0], 3, verify=True, all_logits=True, taps={})]
        x = torch.cat([step_rows(solo.model, s.n, seed=30 + i) for i, s in enumerate(segs)])
        starts = [0, 3, 4, 7]
        outs = [None] * 3
        batched._verify_batched(x, segs, starts, outs)
        assert outs[1] is None
        for i in (0, 2):
            taps: dict = {}
            want = solo.run(x[starts[i]:starts[i + 1]], segs[i].pos, segs[i].slot,
                            all_logits=True, taps=taps, verify=True, tree=segs[i].tree)
            assert outs[i].shape == want.shape and close_rel(outs[i], want), (layers, i)
            assert set(segs[i].taps) == set(taps) and all(
                close_rel(segs[i].taps[k], v) for k, v in taps.items())
    for error, stays in ((IndexError("rows outside"), True), (RuntimeError("boom"), False)):
        def fail(*args, error=error):
            raise error

        monkeypatch.setattr(batched.static, "run_verify_batch", fail)
        outs = [None] * 3
        batched._verify_batched(x, segs, starts, outs)
        assert outs == [None] * 3 and batched.batch_verify is stays
