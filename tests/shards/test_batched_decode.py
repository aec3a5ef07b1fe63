"""A batched decode step (several sequences, one token each, each in its own KV slot at its own
position) equals each sequence's own eager decode step, and leaves every other slot alone."""

from __future__ import annotations

import random

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import GroupTaps, RangeExecutor, group_rows
from layersplit.shards.fused import fuse_projections
from layersplit.shards.graphs import batch_bucket, batch_window
from layersplit.shards.kv_cache import KVCache, KVLayout

from tests.helpers import step_rows

SLOTS, MAX_LEN, BUCKET = 5, 48, 16
PROMPT_LENS = (7, 16, 3, 20, 9)  # per slot: positions cross graph-bucket boundaries


def test_batch_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17, 64, 65, 128, 129)] == \
        [2, 2, 4, 8, 16, 32, 64, 128, 128, 192]


@pytest.mark.parametrize(("slots", "n_slots", "window"), [
    ([0, 2, 3], 5, (0, 4)),  # slot 1 pads
    ([3, 1], 5, (1, 4)),  # the window stays inside the cache
    ([0, 4], 5, (0, 5)),  # the span's bucket (8) is wider than the cache
    ([7], 100, (7, 2)),
    ([99], 100, (98, 2)),
    ([10, 40], 100, (10, 32)),  # two rows, but a span of 31
    ([10, 42], 100, (10, 64)),
    ([90, 99], 100, (84, 16)),
    ([0, 99], 200, (0, 128)),
    ([0], 1, (0, 1)),
])
def test_batch_window(slots, n_slots, window):
    assert batch_window(slots, n_slots) == window


def test_batch_window_covers_the_slots():
    rng = random.Random(0)
    for _ in range(500):
        n_slots = rng.randint(1, 300)
        slots = rng.sample(range(n_slots), rng.randint(1, min(n_slots, 70)))
        lo, bp = batch_window(slots, n_slots)
        assert 0 <= lo and lo + bp <= n_slots and all(lo <= s < lo + bp for s in slots)
        assert bp == n_slots or bp == batch_bucket(max(slots) - min(slots) + 1)


@pytest.mark.parametrize("slots", [[], [1, 1], [5], [-1]])
def test_batch_window_rejects(slots):
    with pytest.raises(ValueError):
        batch_window(slots, 5)


def test_scratch_row_is_not_visible():
    kv = KVCache(KVLayout(2, 2, 4, torch.float32), max_len=10, slots=3)
    assert kv.k.shape == (2, 3, 10, 2, 4) and kv.k_store.shape == (2, 3, 11, 2, 4)
    assert kv.k.data_ptr() == kv.k_store.data_ptr()
    assert kv.nbytes == 2 * kv.k_store.numel() * 4


def _range(ckpt, start: int, end: int, fused: bool):
    model = load_layer_range(ckpt, start, end)
    if fused:
        fuse_projections(model, compile=False)
    return model


def _prefilled(ckpt, start: int, end: int, fused: bool) -> RangeExecutor:
    """An executor with a static decoder whose slots hold prompts of PROMPT_LENS."""
    ex = RangeExecutor(_range(ckpt, start, end, fused), MAX_LEN, SLOTS, static_decode=True,
                       graph_bucket=BUCKET)
    for slot, n in enumerate(PROMPT_LENS):
        ex.run(step_rows(ex.model, n, seed=slot), 0, slot)
    return ex


def _reference(ckpt, start: int, end: int, batched: RangeExecutor) -> RangeExecutor:
    """The plain eager path (separate projections) on a copy of `batched`'s KV cache."""
    ref = RangeExecutor(load_layer_range(ckpt, start, end), MAX_LEN, SLOTS,
                        static_decode=False)
    ref.kv.k_store.copy_(batched.kv.k_store)
    ref.kv.v_store.copy_(batched.kv.v_store)
    return ref


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layers", [(0, 6), (2, 4)])
@pytest.mark.parametrize("slots", [[0, 2, 3], [3, 1], [0, 4], [4, 0, 1, 2, 3], [2]])
def test_batched_step_equals_eager_steps(tiny_models, layers, slots, fused):
    _check_batched(open_checkpoint(tiny_models["qwen3"]), layers, slots, fused)


@pytest.mark.parametrize("family", ["gpt_oss", "glm4_moe"])
def test_batched_step_with_sinks_windows_and_partial_rotary(tiny_models, family):
    """gpt-oss (attention sinks, sliding layers shorter than the prompts) and GLM-4.5 (partial
    rotary, grouped sigmoid routing) in batched steps, their weights in the GPU layout."""
    _check_batched(open_checkpoint(tiny_models[family]), (0, 6), [0, 2, 3], True)


def _check_batched(ckpt, layers: tuple[int, int], slots: list[int], fused: bool) -> None:
    ex = _prefilled(ckpt, *layers, fused)
    ref = _reference(ckpt, *layers, ex)
    assert ex.static is not None
    positions = [PROMPT_LENS[s] for s in slots]
    for step in range(3):  # consecutive steps; slot 3 crosses a graph bucket (20 -> 32 keys)
        x = step_rows(ex.model, len(slots), seed=100 + step)
        before = ex.kv.k.clone(), ex.kv.v.clone()
        out = ex.static.run_batch(x, slots, positions)
        want = torch.cat([ref.run(x[i:i + 1], p, s)
                          for i, (s, p) in enumerate(zip(slots, positions))])
        assert out.shape == want.shape and out.dtype == want.dtype
        # hidden rows of a middle range reach ~25: float32 rounding of the batched matmul
        assert torch.allclose(out, want, atol=1e-4, rtol=1e-5), (out - want).abs().max()
        for s in range(SLOTS):
            if s in slots:  # the new rows: as the eager step wrote them
                assert torch.allclose(ex.kv.k[:, s], ref.kv.k[:, s], atol=1e-5)
                assert torch.allclose(ex.kv.v[:, s], ref.kv.v[:, s], atol=1e-5)
            else:  # padding slots in the window and slots outside it: untouched
                assert torch.equal(ex.kv.k[:, s], before[0][:, s])
                assert torch.equal(ex.kv.v[:, s], before[1][:, s])
        positions = [p + 1 for p in positions]


def test_run_batch_rejects_bad_steps(tiny_llama):
    ex = _prefilled(open_checkpoint(tiny_llama), 0, 6, fused=False)
    ids = torch.tensor([5, 6])
    with pytest.raises(ValueError):
        ex.static.run_batch(ids, [0, 1], [3])
    with pytest.raises(ValueError):
        ex.static.run_batch(ids, [0, 0], [3, 4])
    with pytest.raises(ValueError):
        ex.static.run_batch(ids, [0, 1], [3, MAX_LEN])


def test_single_steps_after_a_batched_step(tiny_llama):
    """A batched step's KV rows serve later single-sequence static steps like eager ones."""
    ckpt = open_checkpoint(tiny_llama)
    ex = _prefilled(ckpt, 0, 6, fused=False)
    ref = _reference(ckpt, 0, 6, ex)
    slots = [1, 3]
    positions = [PROMPT_LENS[s] for s in slots]
    ex.static.run_batch(torch.tensor([11, 12]), slots, positions)
    for s, p, t in zip(slots, positions, (11, 12)):
        ref.run(torch.tensor([t]), p, s)
    for s, p in zip(slots, positions):
        a, b = ex.run(torch.tensor([9]), p + 1, s), ref.run(torch.tensor([9]), p + 1, s)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_batched_step_taps_each_sequences_rows(tiny_models):
    """Sequences that feed the draft batch with the others: a batched step returns each one's
    rows of the tapped layers, in the order asked, as its own eager step computes them (a range
    whose tap is its last layer's, normed, included)."""
    ckpt = open_checkpoint(tiny_models["qwen3"])
    ex = RangeExecutor(_range(ckpt, 0, 6, True), MAX_LEN, SLOTS, static_decode=True,
                       graph_bucket=BUCKET, taps=(1, 5))
    for slot, n in enumerate(PROMPT_LENS):
        ex.run(step_rows(ex.model, n, seed=slot), 0, slot)
    ref = RangeExecutor(load_layer_range(ckpt, 0, 6), MAX_LEN, SLOTS, static_decode=False,
                        taps=(1, 5))
    ref.kv.k_store.copy_(ex.kv.k_store)
    ref.kv.v_store.copy_(ex.kv.v_store)
    slots = [4, 0, 2]
    positions = [PROMPT_LENS[s] for s in slots]
    x = step_rows(ex.model, len(slots), seed=7)
    taps: dict[int, torch.Tensor] = {}
    ex.static.run_batch(x, slots, positions, taps)
    assert sorted(taps) == [1, 5]
    for i, (s, p) in enumerate(zip(slots, positions)):
        want: dict[int, torch.Tensor] = {}
        ref.run(x[i:i + 1], p, s, taps=want)
        for layer in (1, 5):
            got = taps[layer][i:i + 1]
            assert got.shape == want[layer].shape
            assert torch.allclose(got, want[layer], atol=1e-4, rtol=1e-5), layer


def test_a_batched_groups_taps_are_each_segments_rows_and_the_whole_groups():
    """A segment of a batched decode step reads its row of the group's tapped rows
    (`GroupTaps`); `group_rows` gives the group's rows themselves only for every segment of
    that group, in its order (what a shard parks by one copy), else None."""
    rows = {1: torch.arange(12.0).reshape(3, 4), 5: -torch.arange(12.0).reshape(3, 4)}
    taps = [GroupTaps(rows, j) for j in range(3)]
    assert [sorted(t) for t in taps] == [[1, 5]] * 3 and all(len(t) == 2 and t for t in taps)
    for j, t in enumerate(taps):
        assert torch.equal(t[1], rows[1][j:j + 1]) and torch.equal(t[5], rows[5][j:j + 1])
        assert dict(t).keys() == {1, 5}
    with pytest.raises(KeyError):
        taps[0][2]
    assert group_rows(taps) is rows
    assert group_rows(taps[:2]) is None  # (a segment of the group not fed: apart)
    assert group_rows([taps[1], taps[0], taps[2]]) is None  # (out of order)
    other = {k: v.clone() for k, v in rows.items()}
    assert group_rows([taps[0], GroupTaps(other, 1), taps[2]]) is None  # (another step's)
    assert group_rows([taps[0], {1: rows[1][1:2], 5: rows[5][1:2]}, taps[2]]) is None
    assert group_rows([{1: rows[1]}]) is None and group_rows([]) is None
    assert group_rows([GroupTaps({}, 0)]) is None  # (a range with no tapped layer)
