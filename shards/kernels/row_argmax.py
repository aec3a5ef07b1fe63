"""The greedy draw of a step's logit rows (`finite.greedy_draw`) as two Triton launches.

torch's `max(dim=-1)` reduces a row of the vocabulary in one program per row: 21.4 us at
102,400 float32 entries, 26.2 at 128,256 on an H200, for one row (`bench/moe_kernel_sweep.py`'s
`time_us`, 2026-11-30), the whole GPU idle but one SM; and the draw's non-finite check is two
launches more (`isfinite`, `masked_fill`). Here the first launch spreads each row over programs
of `BLOCK` entries, each writing its block's maximum and where it first occurs (compared in
float32: 16-bit and float32 rows only); the second
reduces those per row and writes the ids and the ids marked -1 where the row's maximum is NaN or
infinite. torch's rules hold: the first index among equal maxima; a NaN anywhere wins the row
(the first NaN's index), so a row holding one is marked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start

BLOCK = 2048  # a row's entries per program of the first launch
WARPS = 4
MAX_PARTS = 4096  # partials per row the second launch reduces in one load (vocabularies to 8M)


@triton.jit
def _block_max(X, s_x, PV, PI, V, P, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(X + row * s_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    nan = v != v
    big = 2**31 - 1
    first_nan = tl.min(tl.where(nan, offs, big), 0)
    key = tl.where(nan, float("-inf"), v)
    top = tl.max(key, 0)
    first_top = tl.min(tl.where(key == top, offs, big), 0)
    has_nan = first_nan < big
    tl.store(PV + row * P + part, tl.where(has_nan, float("nan"), top))
    tl.store(PI + row * P + part, tl.where(has_nan, first_nan, first_top))


@triton.jit
def _parts_max(PV, PI, IDS, MARKED, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    ok = j < P
    v = tl.load(PV + row * P + j, mask=ok, other=float("-inf"))
    i = tl.load(PI + row * P + j, mask=ok, other=2**31 - 1)
    big = 2**31 - 1
    nan = v != v
    first_nan = tl.min(tl.where(nan, i, big), 0)  # (blocks in order: the row's first NaN)
    key = tl.where(nan, float("-inf"), v)
    top = tl.max(key, 0)
    first_top = tl.min(tl.where(key == top, i, big), 0)
    has_nan = first_nan < big
    ids = tl.where(has_nan, first_nan, first_top).to(tl.int64)
    finite = (top != float("inf")) & (top != float("-inf")) & ~has_nan
    tl.store(IDS + row, ids)
    tl.store(MARKED + row, tl.where(finite, ids, -1))


def takes(rows: torch.Tensor) -> bool:
    """Whether `row_argmax` takes `rows`: (n, V) of contiguous entries, 0 < V <= MAX_PARTS *
    BLOCK, float32 or a 16-bit float (it compares in float32)."""
    return rows.dim() == 2 and rows.stride(1) == 1 and \
        0 < rows.shape[1] <= MAX_PARTS * BLOCK and \
        rows.dtype in (torch.float32, torch.bfloat16, torch.float16)


def row_argmax(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the argmax of each row of `rows` (n, V), the same ids with -1 where the row's maximum
    is NaN or infinite), both int64 (n,), on the rows' device, without a wait for it. Rows
    it does not take (`takes`) raise ValueError."""
    if not takes(rows):
        raise ValueError(f"row_argmax: rows must be (n, V) float32, bfloat16 or float16 of "
                         f"contiguous entries, 0 < V <= {MAX_PARTS * BLOCK}; got "
                         f"{tuple(rows.shape)} {rows.dtype} strides {rows.stride()}")
    n, v = rows.shape
    parts = triton.cdiv(v, BLOCK)
    pv = torch.empty(n, parts, dtype=torch.float32, device=rows.device)
    pi = torch.empty(n, parts, dtype=torch.int32, device=rows.device)
    ids = torch.empty(n, dtype=torch.int64, device=rows.device)
    marked = torch.empty_like(ids)
    _block_max[(n, parts)](rows, rows.stride(0), pv, pi, v, parts, BLOCK=BLOCK,
                           num_warps=WARPS, **pdl(rows))
    _parts_max[(n,)](pv, pi, ids, marked, parts,
                     BLOCK_P=max(2, triton.next_power_of_2(parts)), num_warps=WARPS, **pdl(pv))
    return ids, marked
