"""`_flash_lower_right`'s fallback (`shards.layers.attention`): the flash op refusing K/V with
fewer heads than the queries switches this process to repeating them; running out of memory is
not that refusal. The op itself is torch's, replaced here by a stand-in that fails as told (the
real one runs in `tests/gpu/test_attend.py`)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers import attention


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 8, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(9, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def _stand_in(monkeypatch, fail) -> list[int]:
    """The flash op: raises `fail(kv_heads)` when that is an exception, else answers zeros."""
    heads: list[int] = []

    def op(q, k, v, dropout, is_causal, return_debug_mask, scale):
        assert is_causal and dropout == 0.0
        heads.append(k.shape[1])
        err = fail(k.shape[1])
        if err is not None:
            raise err
        return (torch.zeros_like(q),)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", op)
    monkeypatch.setattr(attention, "_FLASH_GQA", {})
    return heads


def test_out_of_memory_is_raised_and_gqa_stays_on(monkeypatch):
    full = [True]
    heads = _stand_in(monkeypatch, lambda g: torch.cuda.OutOfMemoryError("CUDA out of memory")
                      if full[0] else None)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        attention._flash_lower_right(*_inputs(), None)
    assert heads == [2]  # not tried again with 4 x the K/V
    full[0] = False  # memory freed: the next chunk passes its 2 K/V heads as they are
    assert attention._flash_lower_right(*_inputs(), None).shape == (5, 8, 64)
    assert heads == [2, 2] and attention._FLASH_GQA == {"gqa": True}


def test_an_op_that_refuses_gqa_gets_repeated_heads_from_then_on(monkeypatch):
    heads = _stand_in(monkeypatch, lambda g: RuntimeError("heads") if g != 8 else None)
    assert attention._flash_lower_right(*_inputs(), None).shape == (5, 8, 64)
    assert attention._flash_lower_right(*_inputs(), None).shape == (5, 8, 64)
    assert heads == [2, 8, 8] and attention._FLASH_GQA == {"gqa": False}


def test_a_failure_after_gqa_ran_costs_only_that_call(monkeypatch):
    """A failing call once K/V of fewer heads have run is not the op refusing GQA: the caller's
    mask path runs for that chunk, and the next chunk passes its 2 K/V heads again."""
    fail = [False]
    heads = _stand_in(monkeypatch, lambda g: RuntimeError("workspace") if fail[0] else None)
    assert attention._flash_lower_right(*_inputs(), None).shape == (5, 8, 64)
    fail[0] = True
    assert attention._flash_lower_right(*_inputs(), None) is None
    fail[0] = False
    assert attention._flash_lower_right(*_inputs(), None).shape == (5, 8, 64)
    assert heads == [2, 2, 2] and attention._FLASH_GQA == {"gqa": True}
