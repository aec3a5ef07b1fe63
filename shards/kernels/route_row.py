"""One row's MoE routing as a Triton function (not a kernel): the softmax over its E router
logits and their top k, renormalised (Qwen, Mixtral), or the top k logits and a softmax over
those k (gpt-oss). Two kernels call it: `moe_gemv._route` (a program a row, after the router's
GEMV) and the router's GEMV itself (`gemv.gemv_route`: its last program to finish routes the
row, one launch fewer a MoE layer's step)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_row(LOGITS, W, IDS, t, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr,
              K_POW2: tl.constexpr, NORM: tl.constexpr, SOFTMAX_TOP: tl.constexpr,
              FRESH: tl.constexpr = False):
    """Row t of LOGITS (rows of E) routed: its k weights stored in W (in W's dtype, rounded
    once) and expert ids in IDS (rows of K), descending, the lower id first among equals (as
    `torch.topk`). FRESH: the logits were written by other programs of the same launch (read
    past the L1 cache)."""
    offs = tl.arange(0, E_POW2)
    valid = offs < E
    if FRESH:
        z = tl.load(LOGITS + t * E + offs, mask=valid, other=float("-inf"),
                    cache_modifier=".cg").to(tl.float32)
    else:
        z = tl.load(LOGITS + t * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX_TOP:  # gpt-oss: the top k logits, then a softmax over those k
        p = tl.where(valid, z, float("-inf"))
    else:  # a softmax over all E, then its top k
        z = z - tl.max(z, axis=0)
        ez = tl.where(valid, tl.exp(z), 0.0)
        p = ez / tl.sum(ez, axis=0)
        p = tl.where(valid, p, -1.0)
    slots = tl.arange(0, K_POW2)
    wv = tl.zeros([K_POW2], dtype=tl.float32)
    iv = tl.zeros([K_POW2], dtype=tl.int32)
    for kk in tl.static_range(K):  # descending, the lower id first among equals (as topk)
        best = tl.max(p, axis=0)
        # (NaN logits match nothing: an expert id past E would read past the weights)
        pick = tl.minimum(tl.min(tl.where((p == best) & valid, offs, E_POW2), axis=0), E - 1)
        wv = tl.where(slots == kk, best, wv)
        iv = tl.where(slots == kk, pick, iv)
        p = tl.where(offs == pick, float("-inf"), p)
    chosen = slots < K
    if SOFTMAX_TOP:
        ez = tl.where(chosen, tl.exp(wv - tl.max(tl.where(chosen, wv, float("-inf")), axis=0)),
                      0.0)
        wv = ez / tl.sum(ez, axis=0)
    elif NORM:
        wv = wv / tl.sum(tl.where(chosen, wv, 0.0), axis=0)
    tl.store(W + t * K + slots, wv.to(W.dtype.element_ty), mask=chosen)  # (rounded once)
    tl.store(IDS + t * K + slots, iv.to(tl.int64), mask=chosen)
