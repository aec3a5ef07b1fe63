"""The last shard's logits processors and logprobs (`shards.sampling`)."""

from __future__ import annotations

import math
import sys

import torch
from layersplit.shards.sampling import (
    check_processors,
    logprob_entries,
    mask_bits,
    pack_bias,
    pack_mask,
    process_logits,
)


def test_mask_round_trip_and_processing_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 37, generator=g)
    allowed = torch.rand(37, generator=g) > 0.5
    assert torch.equal(mask_bits(pack_mask(allowed), 37, torch.device("cpu")), allowed)
    seen = torch.zeros(37, dtype=torch.bool)
    seen[[3, 4]] = True
    sample = {"rep": 2.0, "rep_mask": pack_mask(seen), "bias": pack_bias([4, 5], [1.0, -2.0]),
              "mask": pack_mask(allowed)}
    want = logits.clone()
    for t in (3, 4):
        want[:, t] = torch.where(want[:, t] > 0, want[:, t] / 2, want[:, t] * 2)
    want[:, 4] += 1.0
    want[:, 5] -= 2.0
    want[:, ~allowed] = float("-inf")
    assert torch.equal(process_logits(logits, sample), want)
    assert process_logits(logits, {"temperature": 1.0}) is logits  # nothing to do: no copy


def test_cpu_logits_keep_the_torch_path(monkeypatch):
    """The token-mask kernel (`shards.kernels.token_mask`) is for CUDA logits: on a CPU, even
    with Triton's interpreter on, `process_logits` is the torch path, and never imports it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, "layersplit.shards.kernels.token_mask", raising=False)
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0]])
    sample = {"rep": 3.0, "rep_mask": pack_mask(torch.tensor([1, 1, 0, 0, 1]) > 0),
              "mask": pack_mask(torch.tensor([1, 1, 1, 0, 1]) > 0)}
    want = torch.tensor([[2.0 / 3.0, -3.0, 3.0, float("-inf"), -6.0]])
    assert torch.equal(process_logits(logits, sample), want)
    assert "layersplit.shards.kernels.token_mask" not in sys.modules


def test_logprob_entries_are_of_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    (tok, lp, top_ids, top_lps), = logprob_entries(logits, [1], 0.5, 2)
    want = torch.log_softmax(logits / 0.5, -1)[0]
    assert tok == 1 and lp == float(want[1])
    assert top_ids == [0, 1] and top_lps == [float(want[0]), float(want[1])]
    (_, _, ids, lps), = logprob_entries(logits, [0], 0.0, 4)  # greedy: the logits' own
    assert math.fsum(math.exp(v) for v in lps) == 1.0 or abs(
        math.fsum(math.exp(v) for v in lps) - 1) < 1e-6
    assert ids == [0, 1, 2, 3]


def test_bad_processor_fields_are_named():
    assert "lp" in check_processors({"lp": -1}, 10)
    assert "outside the vocabulary" in check_processors({"bias": pack_bias([10], [1.0])}, 10)
    assert "bias must be bytes" in check_processors({"bias": b"123"}, 10)
    assert "rep=0" in check_processors({"rep": 0, "rep_mask": pack_mask(torch.ones(10) > 0)},
                                        10)
    assert "rep_mask must be bytes" in check_processors({"rep": 1.1, "rep_mask": [1]}, 10)
    assert "mask" in check_processors({"mask": b"not zlib"}, 10)
    assert "mask holds 8 bits" in check_processors({"mask": pack_mask(torch.ones(8) > 0)}, 10)
    assert check_processors({"lp": 3, "bias": pack_bias([1], [2]), "mask": pack_mask(
        torch.ones(10) > 0)}, 10) is None
    # a mask sent after its step (`late_mask`): only true, and never with a mask of its own
    assert "late_mask" in check_processors({"late_mask": 1}, 10)
    assert "late_mask" in check_processors({"late_mask": True, "mask": pack_mask(
        torch.ones(10) > 0)}, 10)
    assert check_processors({"late_mask": True}, 10) is None


def test_processors_that_outgrow_a_step_fail_their_request_by_name():
    import pytest
    from layersplit.runtime.decoding import Decoding, ProcessorsTooLarge, StepFields

    f = StepFields(Decoding(frequency_penalty=1.0), [1, 2], [0], vocab=5000, budget=800)
    assert f(list(range(50))) is not None  # 50 entries: 400 bytes
    with pytest.raises(ProcessorsTooLarge, match="more than the 800 one sequence may"):
        f(list(range(200)))
