"""Deterministic mode (`deterministic = true`, `RangeExecutor.deterministic`): a verify step's
rows each run through the one-row decode step a plain decode step takes (the captured graph on
a GPU; here its uncaptured CPU form), so the verify rows' logits are a plain decode's, bit for
bit. (That it also forms no batched steps shows on a GPU only: a CPU never batches.)"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor

DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _executor(path, deterministic: bool, taps: tuple[int, ...] = (),
              device: str = "cpu", dtype: torch.dtype = torch.float32) -> RangeExecutor:
    ex = RangeExecutor(load_layer_range(open_checkpoint(path), 0, 6, dtype, device), 128, 2,
                       device, static_decode=True, graph_bucket=16, taps=taps)
    ex.deterministic = deterministic
    return ex


@pytest.mark.parametrize("device", DEVICES)
def test_verify_rows_equal_plain_decode_steps_bit_for_bit(target, device):
    """(On a GPU in bf16: the captured one-row graph for plain and verify rows alike.)"""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    prompt = torch.arange(3, 33, device=device)
    plain, det = (_executor(target, d, (1, 4), device, dtype) for d in (False, True))
    for ex in (plain, det):
        ex.run(prompt, 0)
    tokens = [7, 11, 5, 9, 2]  # the last token and four proposals, positions 30..34
    want, want_taps = [], []
    for i, t in enumerate(tokens):
        taps: dict = {}
        want.append(plain.run(torch.tensor([t], device=device), 30 + i, taps=taps).clone())
        want_taps.append({k: v.clone() for k, v in taps.items()})
    steps = []
    inner = det.static._step
    det.static._step = lambda *a: steps.append(a) or inner(*a)
    taps = {}
    got = det.run(torch.tensor(tokens, device=device), 30, all_logits=True, verify=True,
                  taps=taps)
    assert torch.equal(got, torch.cat(want))
    for layer in (1, 4):
        assert torch.equal(taps[layer], torch.cat([t[layer] for t in want_taps]))
    assert {a[2] for a in steps} == {1}  # one-row static steps only, no verify graph
    if device == "cpu":  # on a GPU, the capture calls of the 32- and 48-key graphs instead
        assert len(steps) == 5
    # both caches hold the same rows afterwards: decoding goes on alike
    a = plain.run(torch.tensor([3], device=device), 35)
    b = det.run(torch.tensor([3], device=device), 35)
    assert torch.equal(a, b)


def _tree_against_plain(path, hybrid: bool = False) -> None:
    """Tree rows [a, b, c, d] at positions 30.. (parents 0, 1, 0: a chain a-b-c, and d under
    a), the path a -> d kept: rows a and d equal plain steps of a then d, bit for bit, and so
    does the step after, at position 32."""
    plain, det = (RangeExecutor(load_layer_range(open_checkpoint(path), 0, 6), 128, 2,
                                static_decode=True, graph_bucket=4) for _ in range(2))
    det.deterministic = True
    prompt = torch.arange(3, 33)
    for ex in (plain, det):
        ex.run(prompt, 0)
    a, b, c, d = 7, 11, 5, 9
    want = [plain.run(torch.tensor([t]), 30 + i) for i, t in enumerate((a, d))]
    got = det.run(torch.tensor([a, b, c, d]), 30, all_logits=True, verify=True, tree=[0, 1, 0])
    assert torch.equal(got[0:1], want[0]) and torch.equal(got[3:4], want[1])
    det.before_step(0, 32, [3])  # row 3 (d) kept: moved to position 31
    assert torch.equal(det.run(torch.tensor([4]), 32), plain.run(torch.tensor([4]), 32))
    if hybrid:
        assert torch.equal(det.kv.state, plain.kv.state)


def test_tree_verify_rows_equal_plain_steps_along_the_kept_path(target):
    _tree_against_plain(target)


def test_hybrid_verify_rows_take_the_per_slot_step(hybrid_models):
    """A hybrid range: each verify row through the slot's one-row step (its states advanced
    in place and kept per row, a tree row starting from its parent's)."""
    _tree_against_plain(hybrid_models["qwen3_5"], hybrid=True)
