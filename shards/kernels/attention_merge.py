"""Two partial attentions of the same queries merged by their log-sum-exps, in one kernel.

`shards.layers.attention._cudnn_split` runs a prefill chunk's attention as two cuDNN calls (over
the cached prefix and over the chunk itself); the result is o = (e1 * o1 + e2 * o2) / (e1 + e2),
e_i = exp(lse_i - max). In torch that is ~14 kernels and float32 copies of both outputs (on an
H100 ~0.17 ms a layer for a 2048-token chunk of Qwen3-8B's heads, more than cuDNN saves against
flash attention at short prefixes); here one pass reads each output once and writes the merged
rows straight in the (n, H * D) layout the output projection takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start

BLOCK_ROWS = 16


@triton.jit
def _merge(O1, s1h, s1n, L1, sl1h, sl1n, O2, s2h, s2n, L2, sl2h, sl2n, OUT, s_out, n,
           D: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    rb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (n * H * D may pass 2**31)
    ok = rows < n
    d = tl.arange(0, D)
    l1 = tl.load(L1 + h * sl1h + rows * sl1n, mask=ok, other=0.0)
    l2 = tl.load(L2 + h * sl2h + rows * sl2n, mask=ok, other=0.0)
    big = tl.maximum(l1, l2)
    e1 = tl.exp(l1 - big)
    e2 = tl.exp(l2 - big)
    total = e1 + e2
    w1 = (e1 / total)[:, None]
    w2 = (e2 / total)[:, None]
    o1 = tl.load(O1 + h * s1h + rows[:, None] * s1n + d[None, :], mask=ok[:, None], other=0.0)
    o2 = tl.load(O2 + h * s2h + rows[:, None] * s2n + d[None, :], mask=ok[:, None], other=0.0)
    out = o1.to(tl.float32) * w1 + o2.to(tl.float32) * w2
    tl.store(OUT + rows[:, None] * s_out + h * D + d[None, :], out.to(OUT.dtype.element_ty),
             mask=ok[:, None])


def merge_attention(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor,
                    l2: torch.Tensor) -> torch.Tensor:
    """(n, H * D) merged rows of two attentions of the same n queries: `o1`, `o2` (1, H, n, D)
    any strides with contiguous D; `l1`, `l2` their natural log-sum-exps (1, H, n, 1) float."""
    _, h, n, d = o1.shape
    if o1.stride(3) != 1 or o2.stride(3) != 1 or d & (d - 1):
        raise ValueError("merge_attention: head dim must be contiguous and a power of two")
    out = torch.empty(n, h * d, dtype=o1.dtype, device=o1.device)
    _merge[(triton.cdiv(n, BLOCK_ROWS), h)](
        o1, o1.stride(1), o1.stride(2), l1, l1.stride(1), l1.stride(2),
        o2, o2.stride(1), o2.stride(2), l2, l2.stride(1), l2.stride(2),
        out, out.stride(0), n, D=d, BLOCK_R=BLOCK_ROWS, num_warps=4, **pdl(o1))
    return out
