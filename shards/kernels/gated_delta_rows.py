"""The gated delta rule over a speculative verify step's rows, keeping the state after each row:
one Triton kernel for a layer's n rows.

A hybrid range (Qwen3.5, Qwen3-Next) verifies a chain of draft tokens in one step: the
projections, the conv and the attention layers take the n rows at once, and this kernel runs
the recurrence row after row, as fla-core's fused recurrent kernel does, but stores the
(Hv, Dk, Dv) state after every row (fla's keeps the last only). The next step keeps the state
of the last accepted row (`shards.hybrid_cache.HybridState.settle`). Same math as
`shards.layers.gated_delta.recurrent_gated_delta_rule(keep_states=True)`, the torch reference:
q/k L2-normed (eps 1e-6 inside the root), q scaled by Dk ** -0.5, value head h reading key head
h // (Hv / Hk), everything in float32; the output rounded to v's dtype once.

Program (value block, sequence x value head): the state's (Dk, BV) tile lives in registers
over the n rows, as in fla's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start

BLOCK_V = 8  # the state columns one program keeps (fla's choice for its recurrent kernel)


@triton.jit(do_not_specialize=["T", "HS_BY_SLOT"])
def _recurrent_rows(Q, K, V, G, BETA, H0, OUT, HS, T, scale, SLOTS, HS_BY_SLOT,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, INDEXED: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid = tl.program_id(0).to(tl.int64)
    nv = tl.cdiv(DV, BV)
    i_v, i_nh = pid % nv, pid // nv
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < DK, o_v < DV
    mask_h = mask_k[:, None] & mask_v[None, :]
    tile = o_k[:, None] * DV + o_v[None, :]
    h0 = i_nh  # (the sequence's state: its row of H0, or its slot's with INDEXED)
    if INDEXED:
        h0 = tl.load(SLOTS + i_n).to(tl.int64) * HV + i_hv
    h = tl.load(H0 + h0 * DK * DV + tile, mask=mask_h, other=0.0).to(tl.float32)
    for t in range(0, T):
        row = i_n * T + t
        q = tl.load(Q + (row * HK + i_h) * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(K + (row * HK + i_h) * DK + o_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(V + (row * HV + i_hv) * DV + o_v, mask=mask_v, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        g = tl.load(G + row * HV + i_hv).to(tl.float32)
        beta = tl.load(BETA + row * HV + i_hv).to(tl.float32)
        h *= tl.exp(g)
        v = beta * (v - tl.sum(h * k[:, None], 0))
        h += k[:, None] * v[None, :]
        o = tl.sum(h * q[:, None], 0)
        tl.store(OUT + (row * HV + i_hv) * DV + o_v, o.to(OUT.dtype.element_ty), mask=mask_v)
        if HS_BY_SLOT != 0:  # (one row: the state after it over its slot's, in place; a
            # runtime flag, not a constexpr: the eager warm-ups before a capture build the
            # very kernel the capture launches)
            tl.store(HS + h0 * DK * DV + tile, h, mask=mask_h)
        else:
            tl.store(HS + (row * HV + i_hv) * DK * DV + tile, h, mask=mask_h)


def recurrent_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor, states: torch.Tensor,
                   slots: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over n rows of B sequences: q/k (B, n, Hk, Dk) un-normalised, v
    (B, n, Hv, Dv), g (log decay) and beta (B, n, Hv) in any float dtype (the kernel reads them
    as float32: no cast launched), state (B, Hv, Dk, Dv) float32. Writes the state after each
    row into `states` (B, n, Hv, Dk, Dv) float32, contiguous; returns the output (B, n, Hv, Dv)
    in v's dtype. At one row `states` may be `state` itself (`state.unsqueeze(1)`): each
    program reads its tile of the state before it writes the same tile, and no other program
    touches it, so the state advances in place.

    `slots` ((B,) int64, one row each): `state` is a pool of slots (S, Hv, Dk, Dv), sequence i
    reading slot slots[i]'s (a batched step's rows), and `states` either a (B, 1, Hv, Dk, Dv)
    buffer or the pool itself: the state after the row written over the slot's, in place
    (slots distinct but for rows whose state is thrown away: padding rows share one scratch
    slot, whose state their programs then race on, as `index_copy_` with repeated indices
    would: nothing reads it but padding rows, whose outputs are dropped)."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"{hv} value heads do not share {hk} key heads evenly")
    in_pool = slots is not None and states is state
    if slots is not None and (n != 1 or slots.shape != (b,) or slots.dtype != torch.int64 or
                              slots.device != state.device or state.dim() != 4 or
                              state.shape[1:] != (hv, dk, dv) or not state.is_contiguous() or
                              state.dtype != torch.float32):
        raise ValueError(f"recurrent_rows: slots {tuple(slots.shape)} {slots.dtype} take one "
                         f"row each of {b} sequences over a contiguous float32 pool (S, {hv}, "
                         f"{dk}, {dv}), got {n} row(s) and a pool {tuple(state.shape)} "
                         f"{state.dtype}")
    if not in_pool and (states.shape != (b, n, hv, dk, dv) or states.dtype != torch.float32 or
                        not states.is_contiguous()):
        raise ValueError(f"states must be a contiguous float32 ({b}, {n}, {hv}, {dk}, {dv}) "
                         f"tensor, not {tuple(states.shape)} {states.dtype}")
    out = torch.empty((b, n, hv, dv), dtype=v.dtype, device=v.device)
    bv = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, bv) * b * hv,)
    _recurrent_rows[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        state.float().contiguous(), out, states, n, dk ** -0.5,
        q if slots is None else slots, int(in_pool), HK=hk, HV=hv, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=bv, INDEXED=slots is not None,
        num_warps=1, **pdl(q))
    return out
