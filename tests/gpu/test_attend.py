"""`attend` on a GPU: a prefill chunk after the first takes flash attention's lower-right causal
form (`causal=True`), or from a long prefix where `LAYERSPLIT_CUDNN_PREFILL` asks for it, cuDNN's
attention split in two and merged, the same attention as the explicit mask it replaces, within
bf16."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers import attention
from layersplit.shards.layers.attention import _FLASH_GQA, _flash_lower_right, attend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "t", "h", "g", "d"), [
    (5, 37, 4, 4, 64),  # MHA, a short chunk
    (64, 300, 8, 2, 128),  # GQA
    (130, 1200, 24, 4, 256),  # Qwen3.5's attention heads
    (300, 300, 8, 2, 128),  # from position 0: is_causal
])
def test_lower_right_causal_equals_the_mask(n, t, h, g, d, dtype):
    gen = torch.Generator().manual_seed(n * t)
    q = torch.randn(n, h, d, generator=gen)
    keys, values = (torch.randn(t, g, d, generator=gen) for _ in range(2))
    pos = t - n
    mask = torch.arange(t)[None, :] <= (pos + torch.arange(n))[:, None]
    want = attend(q, keys, values, mask, False)  # the CPU's float32 path, masked
    cuda = [x.to("cuda", dtype) for x in (q, keys, values)]
    fast = attend(*cuda, mask.cuda(), True).float().cpu()
    masked = attend(*cuda, mask.cuda(), False).float().cpu()
    assert fast.shape == want.shape == (n, h * d)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert (fast - want).abs().max() <= tol
    # no further from float32 than the masked kernel (twice its distance, or the bound)
    assert (fast - want).abs().max() <= max(2 * (masked - want).abs().max(), tol / 4)
    # and it is the causal attention: a wrong alignment (upper-left) would be far off
    if n < t:  # ... through flash attention itself (no fallback), with K/V of fewer heads
        assert _flash_lower_right(*cuda, None) is not None
        if g != h:
            assert _FLASH_GQA.get("gqa") is True
        upper = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None].repeat_interleave(h // g, 1) if x is not cuda[0]
              else x.transpose(0, 1)[None] for x in cuda), is_causal=True)
        assert (upper[0].transpose(0, 1).reshape(n, -1).float().cpu() - want).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "t", "h", "g", "d"), [
    (5, 37, 4, 4, 64),  # MHA, a short chunk
    (64, 300, 8, 2, 128),  # GQA
    (130, 1200, 24, 4, 256),  # Qwen3.5's attention heads (where cuDNN takes them)
    (64, 64 + 4096, 32, 8, 128),  # a prefix of CUDNN_MIN_PREFIX, where it is on
])
def test_cudnn_split_equals_the_mask(n, t, h, g, d, dtype, monkeypatch):
    monkeypatch.setattr(attention, "_CUDNN", {})  # what an earlier case learnt does not count
    gen = torch.Generator().manual_seed(n * t + 1)
    q = torch.randn(n, h, d, generator=gen)
    keys, values = (torch.randn(t, g, d, generator=gen) for _ in range(2))
    values[: t - n] += 1.0  # the prefix's part and the chunk's differ: a wrong merge shows
    pos = t - n
    mask = torch.arange(t)[None, :] <= (pos + torch.arange(n))[:, None]
    want = attend(q, keys, values, mask, False)  # the CPU's float32 path, masked
    cuda = [x.to("cuda", dtype) for x in (q, keys, values)]
    split = attention._cudnn_split(*cuda, None)
    if d > 128 and split is None:  # this cuDNN does not take the head dim (nothing to check:
        assert attention._CUDNN.get(d) is False or attention._CUDNN.get("gqa") is False
        return  # flash attention runs instead, `test_lower_right_causal_equals_the_mask`)
    assert split is not None, "cuDNN attention should run on this GPU"
    if g != h:  # K/V of fewer heads taken as they are
        assert attention._CUDNN.get("gqa") is True
    split = split.reshape(n, -1).float().cpu()
    masked = attend(*cuda, mask.cuda(), False).float().cpu()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert (split - want).abs().max() <= max(2 * (masked - want).abs().max(), tol / 4)
    if t - n >= 4096:  # `attend` takes it where LAYERSPLIT_CUDNN_PREFILL turns it on
        monkeypatch.setattr(attention, "CUDNN_MIN_PREFIX", 4096)
        assert torch.equal(attend(*cuda, mask.cuda(), True).float().cpu(), split)


def test_merge_kernel_equals_the_torch_merge():
    """`merge_attention` (one Triton kernel) against the float32 formula, on strided inputs
    (cuDNN's outputs need not be contiguous), rows not a multiple of its block."""
    from layersplit.shards.kernels.attention_merge import merge_attention

    gen = torch.Generator().manual_seed(7)
    n, h, d = 37, 6, 64
    o1, o2 = (torch.randn(1, n, h, d, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16)
              for _ in range(2))
    l1, l2 = (torch.randn(1, h, n, 1, generator=gen).mul(8).cuda() for _ in range(2))
    got = merge_attention(o1, l1, o2, l2).float()
    e1, e2 = torch.exp(l1 - torch.maximum(l1, l2)), torch.exp(l2 - torch.maximum(l1, l2))
    want = (o1.float() * e1 + o2.float() * e2) / (e1 + e2)
    want = want.to(torch.bfloat16).float()[0].transpose(0, 1).reshape(n, -1)
    assert got.shape == (n, h * d)
    assert (got - want).abs().max() <= 1e-2  # one bf16 rounding apart at most


def test_a_long_prefix_takes_flash_attention_by_default(monkeypatch):
    """cuDNN's op builds a graph per chunk and prefix length: unless switched on, a chunk over
    a long prefix never calls it."""
    monkeypatch.setattr(attention, "CUDNN_MIN_PREFIX", None)

    def refused(*args, **kwargs):
        raise AssertionError("cuDNN's attention ran")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", refused)
    n, t, h, g, d = 64, 64 + 8192, 32, 8, 128
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(n, h, d, generator=gen)
    keys, values = (torch.randn(t, g, d, generator=gen) for _ in range(2))
    mask = torch.arange(t)[None, :] <= (t - n + torch.arange(n))[:, None]
    cuda = [x.to("cuda", torch.bfloat16) for x in (q, keys, values)]
    want = attend(*cuda, mask.cuda(), False).float().cpu()
    got = attend(*cuda, mask.cuda(), True).float().cpu()
    assert (got - want).abs().max() <= 2e-2
