"""The sampling noise's Triton kernel (`shards.kernels.noise`) against the torch ops it replaces
on a GPU (`shards.sampling.exponential_noise`): the same float32 noise for every token.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1`. The integers are SplitMix64's bit for bit; the logarithm is float64's
(libdevice's on a GPU, torch's on the CPU side), rounded to float32: equal values expected.
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.sampling import _signed, exponential_noise, mix_seed, vocab_noise

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]


@pytest.mark.parametrize("vocab", [1, 1000, 49152, 151_936])
def test_the_kernel_draws_the_torch_ops_noise(vocab):
    from layersplit.shards.kernels import noise

    keys = [mix_seed(s, p) for s, p in ((0, 0), (7, 3), (2**40, 99_999))]
    got = noise.vocab_noise(torch.tensor([_signed(k) for k in keys], device=DEV), vocab)
    ids = torch.arange(vocab, device=DEV).expand(len(keys), vocab)
    want = exponential_noise(keys, ids)
    assert got.shape == (3, vocab) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), want.cpu())


def test_sampling_takes_the_kernel_on_a_gpu(monkeypatch):
    """`vocab_noise` on a CUDA device runs the kernel (and the torch ops elsewhere), with the
    same noise; a failing kernel leaves the torch ops."""
    from layersplit.shards import sampling
    from layersplit.shards.kernels import noise

    if DEV == "cpu":
        pytest.skip("the kernel is taken on CUDA devices only (here: tested directly above)")
    calls = []
    real = noise.vocab_noise
    monkeypatch.setattr(noise, "vocab_noise", lambda *a: calls.append(1) or real(*a))
    keys = [mix_seed(5, p) for p in range(4)]
    got = vocab_noise(keys, 4096, DEV)
    assert calls
    monkeypatch.setattr(noise, "vocab_noise", lambda *a: 1 / 0)
    monkeypatch.setattr(sampling, "_noise_kernel_failed", False)
    again = vocab_noise(keys, 4096, DEV)
    assert sampling._noise_kernel_failed and torch.equal(got, again)
