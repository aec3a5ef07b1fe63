"""The selected experts of a few rows (a decode, verify or small batched step) as Triton GEMV
kernels that read only those experts' weights.

`routed_moe.grouped_experts` runs a grouped GEMM over all E experts: at decode (one row, k of
E experts picked) its tiles are mostly empty, and the sort/scatter around it are a handful of
small kernels per layer. Here, for P = n * k (row, expert) pairs:

1. `_gate_up_act`: one program per (pair, block of the expert's width I) reads that block of the
   expert's gate and up rows once, dots them with the pair's row and writes silu(g) * u;
2. `_down`: one program per (pair, block of H) reads that block of the expert's down rows and
   dots it with the pair's activation, weighted by the router;
3. `_sum_k`: each row's k weighted expert outputs summed in float32, rounded once.

gpt-oss's experts (`oss_moe_gemv`) take the same kernels with their biases and clamped SwiGLU,
their gate and up rows interleaved.

And the routing after the router's GEMV in one program per row, where torch's top-k takes two
kernels (a gather and a bitonic sort) of ~5 us each per layer, and DeepSeek-V3's grouped routing
~17 small kernels: `moe_route` (softmax over the E logits, the top k by repeated argmax,
renormalised: Qwen, Mixtral), `moe_route_softmax_top` (the top k logits, then their softmax:
gpt-oss) and `moe_route_grouped` (sigmoid scores, a correction bias for choosing, grouped top-k,
scaled: DeepSeek-V3, Kimi K2, GLM-4.5).

No sort, no scatter, no host sync: the kernels live inside CUDA graphs. Roundings follow the
torch path (the projections' outputs and silu(g) * u rounded to the activation dtype, each
expert's output times its weight in the product's dtype: float32 where the router's weights
are, `routed_moe.pair_outputs`; the k of a row summed in float32 and rounded once,
`routed_moe.sum_experts`), so results match it within bf16 noise; the
GPU tests compare the two. Registered as a torch custom op so `torch.compile`d code calls it
as one opaque node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.gemv_operands import shared_chunks
from layersplit.shards.kernels.pdl import pdl, pdl_start
from layersplit.shards.kernels.route_row import route_row

# launch shapes measured on an H100 at Qwen3-30B-A3B's expert shape (bench/moe_kernel_sweep.py);
# the shapes that `gate_up_launch` and `down_launch` pick where they were measured better
GATE_UP = {"BLOCK_I": 4, "BLOCK_K": 512, "num_warps": 2}
DOWN = {"BLOCK_O": 16, "BLOCK_K": 256, "num_warps": 8}
SUM_BLOCK = 1024


def gate_up_launch(h: int) -> dict:
    """The gate/up kernel's launch shape for rows of h: a whole row of 2048 (or half of 4096)
    at a load. `bench/moe_kernel_sweep.py --rows 1` (H200, 2026-11-30; the layer's two
    launches, each shape with the other's default): H 2048 (DeepSeek-V2-Lite's and
    Qwen3-30B-A3B's experts) {2, 2048, 1 warp} 38.0 and 21.7 us, the best of 50; H 4096
    (GLM-4.5-Air's) {4, 2048, 4} 84.2 (its best, 8 warps, 84.1). Other widths (gpt-oss's
    2880): `GATE_UP`."""
    if h == 2048:
        return {"BLOCK_I": 2, "BLOCK_K": 2048, "num_warps": 1}
    if h == 4096:
        return {"BLOCK_I": 4, "BLOCK_K": 2048, "num_warps": 4}
    return GATE_UP


def down_launch(i: int) -> dict:
    """The down kernel's launch shape for experts of width i: a whole row at a load where i is
    past 1024 and at most 2048. `bench/moe_kernel_sweep.py --rows 1` (as `gate_up_launch`):
    width 1408, {4, 2048, 2 warps} 40.0 us at DeepSeek-V2-Lite's hidden size (its best 39.9)
    and 88.4 at GLM-4.5-Air's (its best 87.4); `DOWN` ~1.7 and ~7 us slower. Qwen3-30B-A3B's
    768: `DOWN` the best (22.1 us)."""
    if 1024 < i <= 2048:
        return {"BLOCK_O": 4, "BLOCK_K": 2048, "num_warps": 2}
    return DOWN


@triton.jit
def _expert(W, W2, e, E_ROUTED, size, size2, stride, stride2, HAS_W2: tl.constexpr):
    """(Where expert e's weights start, a stride): W + e * size and `stride`; with HAS_W2 and e
    >= E_ROUTED, chunk c = e - E_ROUTED of the shared MLP's weight W2 (`run_gemv`'s `shared`),
    W2 + c * size2 and `stride2`."""
    if HAS_W2:
        routed = e < E_ROUTED
        return (tl.where(routed, W + e * size, W2 + (e - E_ROUTED) * size2),
                tl.where(routed, stride, stride2))
    return W + e * size, stride


@triton.jit
def _gate_up_act(X, W, IDS, A, B, alpha, limit, H: tl.constexpr, WIDTH: tl.constexpr,
                 K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                 OSS: tl.constexpr, W2=None, E_ROUTED=0, F2=0, HAS_W2: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl_start(PDL)
    p = tl.program_id(0)
    ib = tl.program_id(1)
    e = tl.load(IDS + p).to(tl.int64)
    t = p // K
    offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < WIDTH
    # (the up rows `up` rows after the gate's: an expert's I; the shared MLP's F2, W2's chunk
    # c its gate rows c * I .. and up rows F2 + c * I ..)
    base, up = _expert(W, W2, e, E_ROUTED, 2 * WIDTH * H, WIDTH * H, WIDTH, F2, HAS_W2)
    if OSS:  # gpt-oss: gate and up rows interleaved (2i, 2i + 1)
        rows_g = 2 * offs_i
        rows_u = 2 * offs_i + 1
    else:  # the gate's I rows, then the up's
        rows_g = offs_i
        rows_u = up + offs_i
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_K):
        offs_h = h0 + tl.arange(0, BLOCK_K)
        mask_h = offs_h < H
        xv = tl.load(X + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        m2 = mask_i[:, None] & mask_h[None, :]
        wg = tl.load(base + rows_g[:, None] * H + offs_h[None, :], mask=m2, other=0.0)
        wu = tl.load(base + rows_u[:, None] * H + offs_h[None, :], mask=m2, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    dt = A.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if OSS:  # + the biases, then the clamped SwiGLU (`oss_moe.clamped_swiglu`), rounded op by op
        bg = tl.load(B + e * (2 * WIDTH) + rows_g, mask=mask_i, other=0.0).to(tl.float32)
        bu = tl.load(B + e * (2 * WIDTH) + rows_u, mask=mask_i, other=0.0).to(tl.float32)
        # (clamped to the limit as the activations' dtype holds it, as torch's clamp)
        g = tl.minimum((g + bg).to(dt).to(tl.float32), limit).to(dt).to(tl.float32)
        u = tl.minimum(tl.maximum((u + bu).to(dt).to(tl.float32), -limit), limit)
        u = u.to(dt).to(tl.float32)
        ga = (g * alpha).to(dt).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-ga))).to(dt).to(tl.float32)
        gs = (g * sg).to(dt).to(tl.float32)
        out = (u + 1.0).to(dt).to(tl.float32) * gs
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = s * u
    tl.store(A + p * WIDTH + offs_i, out.to(dt), mask=mask_i)


@triton.jit
def _down(A, W, IDS, RW, Y, B, H: tl.constexpr, WIDTH: tl.constexpr, BLOCK_O: tl.constexpr,
          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, W2=None, E_ROUTED=0, F2=0,
          HAS_W2: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_start(PDL)
    p = tl.program_id(0)
    ob = tl.program_id(1)
    offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < H
    e = tl.load(IDS + p).to(tl.int64)
    rw = tl.load(RW + p).to(tl.float32)
    # (rows of an expert's I values; the shared MLP's of F2, W2's chunk c its columns c * I ..)
    base, row = _expert(W, W2, e, E_ROUTED, H * WIDTH, WIDTH, WIDTH, F2, HAS_W2)
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for i0 in range(0, WIDTH, BLOCK_K):
        offs_i = i0 + tl.arange(0, BLOCK_K)
        mask_i = offs_i < WIDTH
        a = tl.load(A + p * WIDTH + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        w = tl.load(base + offs_o[:, None] * row + offs_i[None, :],
                    mask=mask_o[:, None] & mask_i[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    dt = A.dtype.element_ty  # (the projection rounds to the activations' dtype; Y's is the
    # weighted product's: float32 where the router's weights are)
    y = acc.to(dt).to(tl.float32)
    if HAS_BIAS:  # (gpt-oss: the expert's bias, added in the activations' dtype)
        y = (y + tl.load(B + e * H + offs_o, mask=mask_o, other=0.0).to(tl.float32)).to(dt)
        y = y.to(tl.float32)
    tl.store(Y + p * H + offs_o, (y * rw).to(Y.dtype.element_ty), mask=mask_o)


@triton.jit
def _sum_k(Y, OUT, R, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
           HAS_R: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for kk in tl.static_range(K):  # in expert-slot order, in float32, rounded once
        total += tl.load(Y + (t * K + kk) * H + offs, mask=mask, other=0.0).to(tl.float32)
    out = total.to(OUT.dtype.element_ty)
    if HAS_R:  # h + the experts' sum: the sum rounded, then the add (as the torch ops)
        r = tl.load(R + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        out = (r + out.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + t * H + offs, out, mask=mask)


def run_gemv(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, gate_up_cfg: dict | None = None,
             down_cfg: dict | None = None, oss: tuple | None = None,
             residual: torch.Tensor | None = None,
             shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The three launches (`moe_gemv`'s body; the launch shapes are arguments for the sweep).
    `oss`: gpt-oss's experts, (gate/up bias (E, 2I), down bias (E, H), alpha, limit), their
    gate and up rows interleaved in `gate_up`. `residual` (n, H) of x's dtype: added to the
    experts' sum in its last launch (`fused.FusedDecode._moe_row`: the layer's output).
    `shared`: a shared SwiGLU MLP's fused gate/up (2F, H) (the gate's F rows, then the up's)
    and down (H, F) weights, F a multiple of I, read in place as F / I more experts E .. after
    `gate_up` and `down`'s E (chunk c: gate rows c * I .., up rows F + c * I .., down columns
    c * I ..; `grouped_moe.GroupedMoE`), which `idx` may name."""
    n, h = x.shape
    k = idx.shape[1]
    i = down.shape[2]
    gu, dn = gate_up_cfg or gate_up_launch(h), down_cfg or down_launch(i)
    x = x.contiguous()
    ids = idx.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    gu_bias, dn_bias, alpha, limit = oss if oss is not None else (x, x, 0.0, 0.0)
    w2 = {}
    if shared is not None:
        if shared_chunks(shared[0], shared[1], i) is None or shared[1].shape[0] != h or \
                shared[0].dtype != gate_up.dtype or shared[1].dtype != down.dtype or \
                oss is not None:
            raise ValueError(f"moe_gemv: shared experts {tuple(shared[0].shape)}, "
                             f"{tuple(shared[1].shape)} are no gate/up (2F, H) and down (H, F) "
                             f"of the experts' dtype and H ({h}), contiguous, F a multiple of "
                             f"their {i}")
        w2 = {"E_ROUTED": down.shape[0], "F2": shared[1].shape[1], "HAS_W2": True}
    act = torch.empty((n * k, i), dtype=x.dtype, device=x.device)
    _gate_up_act[(n * k, triton.cdiv(i, gu["BLOCK_I"]))](
        x, gate_up, ids, act, gu_bias, float(alpha), float(limit), H=h, WIDTH=i, K=k,
        BLOCK_I=gu["BLOCK_I"], BLOCK_K=gu["BLOCK_K"], OSS=oss is not None,
        W2=None if shared is None else shared[0], **w2, num_warps=gu["num_warps"], **pdl(x))
    y = torch.empty((n * k, h), dtype=torch.promote_types(x.dtype, weights.dtype),
                    device=x.device)
    _down[(n * k, triton.cdiv(h, dn["BLOCK_O"]))](
        act, down, ids, rw, y, dn_bias, H=h, WIDTH=i, BLOCK_O=dn["BLOCK_O"],
        BLOCK_K=dn["BLOCK_K"], HAS_BIAS=oss is not None,
        W2=None if shared is None else shared[1], **w2, num_warps=dn["num_warps"], **pdl(act))
    out = torch.empty_like(x)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or
                                 not residual.is_contiguous()):
        raise ValueError(f"moe_gemv: residual {tuple(residual.shape)} {residual.dtype} is not "
                         f"the rows' {tuple(x.shape)} {x.dtype}, contiguous")
    _sum_k[(n, triton.cdiv(h, SUM_BLOCK))](y, out, x if residual is None else residual, H=h,
                                           K=k, BLOCK=SUM_BLOCK, HAS_R=residual is not None,
                                           **pdl(y))
    return out


@torch.library.custom_op("layersplit::moe_gemv", mutates_args=())
def moe_gemv(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
             shared_down: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[r, j] * down[e] @ (silu(g) * u), (g, u) = gate_up[e] @ x[r], e = idx[r, j]:
    `grouped_experts` for rows `x` (n, H); `gate_up` (E, 2I, H), `down` (E, H, I); with a shared
    MLP's `shared_gate_up` (2F, H) and `shared_down` (H, F), ids E .. E + F / I - 1 name its
    chunks (`run_gemv`'s `shared`); `residual` (n, H): added to the sum (`run_gemv`'s)."""
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("moe_gemv: a shared expert needs both its gate/up and down weights")
    shared = None if shared_gate_up is None else (shared_gate_up, shared_down)
    return run_gemv(x, weights, idx, gate_up, down, shared=shared, residual=residual)


@torch.library.custom_op("layersplit::oss_moe_gemv", mutates_args=())
def oss_moe_gemv(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                 down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts (`oss_moe.OssExperts._grouped`) for rows `x` (n, H): `gate_up`
    (E, 2I, H), its gate and up rows interleaved, `down` (E, H, I) (each expert's matrices
    row-major: the transposes of `OssExperts.fuse`'s layout), their biases (E, 2I) and (E, H),
    and the clamped SwiGLU's `alpha` and `limit`."""
    return run_gemv(x, weights, idx, gate_up, down,
                    oss=(gate_up_bias, down_bias, alpha, limit))


@triton.jit
def _route(LOGITS, W, IDS, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr,
           K_POW2: tl.constexpr, NORM: tl.constexpr, SOFTMAX_TOP: tl.constexpr,
           PDL: tl.constexpr = False):
    pdl_start(PDL)
    route_row(LOGITS, W, IDS, tl.program_id(0), E, E_POW2, K, K_POW2, NORM, SOFTMAX_TOP)


def _route_outputs(logits: torch.Tensor, top_k: int,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return (torch.empty((n, top_k), dtype=dtype or torch.float32, device=logits.device),
            torch.empty((n, top_k), dtype=torch.int64, device=logits.device))


@torch.library.custom_op("layersplit::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, norm: bool,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k), expert ids (n, k)) of router `logits` (n, E): `route`'s softmax, top k
    and renormalisation. The weights are float32, or stored in `dtype` (Qwen's: the row's),
    each rounded once as `.to(dtype)` rounds it, without a launch of its own."""
    n, e = logits.shape
    w, ids = _route_outputs(logits, top_k, dtype)
    _route[(n,)](logits.contiguous(), w, ids, E=e, E_POW2=triton.next_power_of_2(e), K=top_k,
                 K_POW2=triton.next_power_of_2(top_k), NORM=norm, SOFTMAX_TOP=False, **pdl(logits))
    return w, ids


@torch.library.custom_op("layersplit::moe_route_softmax_top", mutates_args=())
def moe_route_softmax_top(logits: torch.Tensor,
                          top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) float32, expert ids (n, k)): the top k of router `logits` (n, E) and a
    softmax over those k (gpt-oss's `OssMoE.forward`)."""
    n, e = logits.shape
    w, ids = _route_outputs(logits, top_k)
    _route[(n,)](logits.contiguous(), w, ids, E=e, E_POW2=triton.next_power_of_2(e), K=top_k,
                 K_POW2=triton.next_power_of_2(top_k), NORM=False, SOFTMAX_TOP=True, **pdl(logits))
    return w, ids


@triton.jit
def _route_grouped(LOGITS, BIAS, W, IDS, scaling, E: tl.constexpr, G: tl.constexpr,
                   EG: tl.constexpr, G_POW2: tl.constexpr, EG_POW2: tl.constexpr,
                   K: tl.constexpr, K_POW2: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   NORM: tl.constexpr, EXTRA: tl.constexpr = 0, EXTRA_POW2: tl.constexpr = 1,
                   PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    gi = tl.arange(0, G_POW2)
    ji = tl.arange(0, EG_POW2)
    valid = (gi[:, None] < G) & (ji[None, :] < EG)
    lin = gi[:, None] * EG + ji[None, :]
    z = tl.load(LOGITS + t * E + lin, mask=valid, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    c = tl.where(valid, s + tl.load(BIAS + lin, mask=valid, other=0.0).to(tl.float32),
                 float("-inf"))
    if G > 1:  # each group scored by its top 2; the best TOPK_GROUP groups stay in the race
        m1 = tl.max(c, axis=1)
        a1 = tl.min(tl.where(c == m1[:, None], ji[None, :], EG_POW2), axis=1)
        m2 = tl.max(tl.where(ji[None, :] == a1[:, None], float("-inf"), c), axis=1)
        gs = tl.where(gi < G, m1 + m2, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):  # the lower group first among equals
            b = tl.max(gs, axis=0)
            pick = tl.min(tl.where((gs == b) & (gi < G) & ~keep, gi, G_POW2), axis=0)
            keep = keep | (gi == pick)
            gs = tl.where(gi == pick, float("-inf"), gs)
        c = tl.where(keep[:, None], c, float("-inf"))
    slots = tl.arange(0, K_POW2)
    wv = tl.zeros([K_POW2], dtype=tl.float32)
    iv = tl.zeros([K_POW2], dtype=tl.int32)
    big = G_POW2 * EG_POW2
    for kk in tl.static_range(K):  # descending, the lower id first among equals (as topk)
        best = tl.max(tl.max(c, axis=1), axis=0)
        pick = tl.minimum(tl.min(tl.min(tl.where((c == best) & valid, lin, big), axis=1),
                                 axis=0), E - 1)  # (NaN: as `_route`)
        hit = lin == pick
        wv = tl.where(slots == kk, tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=1), axis=0), wv)
        iv = tl.where(slots == kk, pick, iv)
        c = tl.where(hit, float("-inf"), c)
    chosen = slots < K
    if NORM:
        wv = wv / (tl.sum(tl.where(chosen, wv, 0.0), axis=0) + 1e-20)
    row = t * (K + EXTRA)
    tl.store(W + row + slots, wv * scaling, mask=chosen)
    tl.store(IDS + row + slots, iv.to(tl.int64), mask=chosen)
    if EXTRA > 0:  # the shared experts' chunks, as experts E .. E + EXTRA - 1 of weight 1
        xs = tl.arange(0, EXTRA_POW2)
        tl.store(W + row + K + xs, tl.full([EXTRA_POW2], 1.0, tl.float32), mask=xs < EXTRA)
        tl.store(IDS + row + K + xs, (E + xs).to(tl.int64), mask=xs < EXTRA)


@torch.library.custom_op("layersplit::moe_route_grouped", mutates_args=())
def moe_route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                      topk_group: int, norm: bool, scaling: float,
                      extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_moe.route_grouped` after its float32 router logits (n, E): sigmoid scores, the
    correction `bias` (E,) added for choosing, groups scored by their top 2, the top k of the
    best `topk_group` groups, their scores renormalised when `norm`, times `scaling`. One
    program per row. `extra`: `extra` more columns, ids E .. E + extra - 1 of weight 1 (a
    shared expert's chunks as experts: `grouped_moe.GroupedMoE.shared_as_experts`)."""
    n, e = logits.shape
    w, ids = _route_outputs(logits, top_k + extra)
    eg = e // n_group
    _route_grouped[(n,)](
        logits.contiguous(), bias.contiguous(), w, ids, float(scaling), E=e, G=n_group, EG=eg,
        G_POW2=triton.next_power_of_2(n_group), EG_POW2=triton.next_power_of_2(eg), K=top_k,
        K_POW2=triton.next_power_of_2(top_k), TOPK_GROUP=topk_group, NORM=norm, EXTRA=extra,
        EXTRA_POW2=max(1, triton.next_power_of_2(extra)), **pdl(logits))
    return w, ids


def _fake_route(logits, top_k, *args):
    return _route_outputs(logits, top_k)


moe_route_softmax_top.register_fake(_fake_route)


@moe_route_grouped.register_fake
def _(logits, bias, top_k, n_group, topk_group, norm, scaling, extra=0):
    return _fake_route(logits, top_k + extra)


@moe_route.register_fake
def _(logits, top_k, norm, dtype=None):
    return _route_outputs(logits, top_k, dtype)


@moe_gemv.register_fake
def _(x, weights, idx, gate_up, down, shared_gate_up=None, shared_down=None, residual=None):
    return torch.empty_like(x)


@oss_moe_gemv.register_fake
def _(x, weights, idx, gate_up, gate_up_bias, down, down_bias, alpha, limit):
    return torch.empty_like(x)
