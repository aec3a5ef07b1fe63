"""`_cudnn_split` (`shards.layers.attention`): a prefill chunk's causal attention as two
attentions, over the cached prefix and over the chunk itself, merged by their log-sum-exps.
cuDNN's op is replaced here by a stand-in that computes the same attention exactly (with its
log-sum-exp) or fails as told, so the merge and the fallbacks are checked on a CPU; the real op
runs in `tests/gpu/test_attend.py`."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers import attention


def _exact(q, k, v, bias, lse, dropout, causal, debug, scale=None):
    """The op's contract: (out (B, H, n, D), log-sum-exp (B, H, n, 1), ...); `causal` upper-left."""
    assert bias is None and lse and dropout == 0.0 and not debug
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if causal:
        n, t = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, t, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), lse


def _stand_in(monkeypatch, fail=lambda q, k: None) -> list[int]:
    heads: list[int] = []

    def op(q, k, v, *args, scale=None):
        heads.append(k.shape[1])
        err = fail(q, k)
        if err is not None:
            raise err
        return _exact(q, k, v, *args, scale=scale)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", op)
    monkeypatch.setattr(attention, "_CUDNN", {})
    return heads


def _inputs(n=6, t=40, h=8, g=2, d=64):
    gen = torch.Generator().manual_seed(n * t)
    q = torch.randn(n, h, d, generator=gen)
    k, v = (torch.randn(t, g, d, generator=gen) for _ in range(2))
    v[: t - n] += 2.0  # the prefix's values and the chunk's differ: a wrong merge shows
    return q, k, v


def _masked(q, k, v, scale=None):
    n, t = q.shape[0], k.shape[0]
    mask = torch.arange(t)[None, :] <= (t - n + torch.arange(n))[:, None]
    return attention.attend(q, k, v, mask, False, scale)  # the CPU float32 path


@pytest.mark.parametrize("scale", [None, 0.05])
def test_the_merge_equals_causal_attention_over_the_whole(monkeypatch, scale):
    heads = _stand_in(monkeypatch)
    q, k, v = _inputs()
    out = attention._cudnn_split(*(x.to(torch.bfloat16) for x in (q, k, v)), scale)
    want = _masked(*(x.to(torch.bfloat16).float() for x in (q, k, v)), scale)
    assert out.dtype == torch.bfloat16 and out.shape == (6, 8, 64)
    # two roundings to bf16 (each part's output, then the merge) of values up to ~3: 2 ulps
    assert (out.float().reshape(6, -1) - want).abs().max() < 3e-2
    assert heads == [2, 2] and attention._CUDNN == {"gqa": True, 64: True}


def test_an_op_that_refuses_gqa_is_not_asked_again_and_heads_are_never_repeated(monkeypatch):
    heads = _stand_in(monkeypatch, lambda q, k: RuntimeError("heads")
                      if k.shape[1] != q.shape[1] else None)
    q, k, v = (x.to(torch.bfloat16) for x in _inputs())
    assert attention._cudnn_split(q, k, v, None) is None  # flash attention runs instead
    assert attention._cudnn_split(q, k, v, None) is None
    assert heads == [2] and attention._CUDNN == {"gqa": False}
    q, k, v = (x.to(torch.bfloat16) for x in _inputs(h=4, g=4))  # as many K/V heads: it runs
    assert attention._cudnn_split(q, k, v, None) is not None
    assert attention._CUDNN == {"gqa": False, 64: True}


def test_a_failure_of_what_already_ran_costs_only_that_call(monkeypatch):
    """cuDNN's workspace out of memory is a plain RuntimeError: after GQA and the head dim
    have run, a failed call falls back for itself and marks nothing off."""
    fail = [False]
    heads = _stand_in(monkeypatch, lambda q, k: RuntimeError("cuDNN workspace") if fail[0]
                      else None)
    q, k, v = (x.to(torch.bfloat16) for x in _inputs())
    assert attention._cudnn_split(q, k, v, None) is not None
    fail[0] = True
    assert attention._cudnn_split(q, k, v, None) is None
    assert attention._CUDNN == {"gqa": True, 64: True}
    fail[0] = False
    assert attention._cudnn_split(q, k, v, None) is not None
    assert heads == [2, 2, 2, 2, 2] and all(g == 2 for g in heads)  # never repeated


def test_a_first_failure_of_the_second_call_marks_nothing_off(monkeypatch):
    """The chunk's own (causal) call ran: GQA and the head dim are known to run, so the
    prefix call failing costs that chunk only."""
    fail = [True]
    _stand_in(monkeypatch, lambda q, k: RuntimeError("workspace")
              if fail[0] and k.shape[2] == 34 else None)  # the 34-key prefix call
    q, k, v = (x.to(torch.bfloat16) for x in _inputs())
    assert attention._cudnn_split(q, k, v, None) is None
    assert attention._CUDNN == {64: True, "gqa": True}
    fail[0] = False
    assert attention._cudnn_split(q, k, v, None) is not None


def test_out_of_memory_is_raised(monkeypatch):
    _stand_in(monkeypatch, lambda q, k: torch.cuda.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        attention._cudnn_split(*(x.to(torch.bfloat16) for x in _inputs()), None)
    assert attention._CUDNN == {}  # nothing learnt from it


def test_float32_and_odd_head_dims_are_not_sent(monkeypatch):
    heads = _stand_in(monkeypatch)
    assert attention._cudnn_split(*_inputs(), None) is None  # float32: the caller's path
    assert attention._cudnn_split(*(x.to(torch.bfloat16) for x in _inputs(d=60)), None) is None
    assert heads == []


def test_the_switch_is_off_unless_set():
    """cuDNN's split builds a graph per chunk and prefix length: off unless asked for."""
    assert attention.cudnn_min_prefix(None) is None
    assert attention.cudnn_min_prefix("") is None and attention.cudnn_min_prefix("0") is None
    assert attention.cudnn_min_prefix("00") is None and attention.cudnn_min_prefix("+0") is None
    assert attention.cudnn_min_prefix(" 4096 ") == 4096
    for bad in ("yes", "-1", "4k"):
        with pytest.raises(ValueError, match="LAYERSPLIT_CUDNN_PREFILL"):
            attention.cudnn_min_prefix(bad)
