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
    plain, det, other = (_executor(target, d, (1, 4), device, dtype)  # other: default mode
                         for d in (False, True, False))
    for ex in (plain, det, other):
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
    assert [a[2] for a in steps] == [1] * 5  # five one-row static steps, no verify graph
    if device == "cpu":  # the default mode's 5-row verify step rounds otherwise: it can tell
        dflt = other.run(torch.tensor(tokens), 30, all_logits=True, verify=True)
        assert not torch.equal(dflt, torch.cat(want))
    # both caches hold the same rows afterwards: decoding goes on alike
    a = plain.run(torch.tensor([3], device=device), 35)
    b = det.run(torch.tensor([3], device=device), 35)
    assert torch.equal(a, b)


def test_tree_verify_rows_keep_the_tree_rows_in_place(target):
    """A token tree in deterministic mode: each row at its depth's position, its K/V laid
    where the default mode's tree step leaves them; the next step agrees with the default."""
    prompt = torch.arange(3, 33)
    det, dflt = _executor(target, True), _executor(target, False)
    for ex in (det, dflt):
        ex.run(prompt, 0)
    tree = [0, 1, 0]  # parents of rows 1..3 (depth-first): a chain of two under the root, a sibling
    tokens = torch.tensor([7, 11, 5, 9])
    a = det.run(tokens, 30, all_logits=True, verify=True, tree=tree)
    b = dflt.run(tokens, 30, all_logits=True, verify=True, tree=tree)
    assert (a - b).abs().max().item() < 1e-4
    for ex in (det, dflt):  # keep the root and its sibling child (rows 0, 3), as a verdict does
        ex.before_step(0, 32, [0, 3])
    a, b = (ex.run(torch.tensor([4]), 32) for ex in (det, dflt))
    assert (a - b).abs().max().item() < 1e-4

