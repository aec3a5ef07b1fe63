"""Sampling's exponential noise of a whole vocabulary (`shards.sampling.vocab_noise`) as one
Triton kernel on a GPU, where the torch version is ~20 elementwise kernels (int64 SplitMix64,
then the logarithm): a sampled decode step of a small model would spend more on them than on
its sampling. Bit for bit the torch version's integers; the logarithm is float64's, rounded to
float32 (`tests/gpu/test_noise.py` compares the two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _vocab_noise(KEYS, OUT, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    key = tl.load(KEYS + row).to(tl.uint64)
    z = key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52
    tl.store(OUT + row * V + offs, (-tl.log(u)).to(tl.float32), mask=mask)


def vocab_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 noise of each row's int64 key (`keys` on the device)."""
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    block = 1024
    _vocab_noise[(keys.shape[0], triton.cdiv(vocab, block))](keys, out, vocab, BLOCK=block,
                                                             num_warps=4)
    return out
