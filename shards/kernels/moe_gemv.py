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

And the routing after the router's GEMV (`moe_route`: softmax over the E logits, the top k by
repeated argmax, renormalised) in one program per row, where torch's top-k takes two kernels
(a gather and a bitonic sort) of ~5 us each per layer.

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

# launch shapes measured on an H100 at Qwen3-30B-A3B's expert shape (bench/moe_kernel_sweep.py)
GATE_UP = {"BLOCK_I": 4, "BLOCK_K": 512, "num_warps": 2}
DOWN = {"BLOCK_O": 16, "BLOCK_K": 256, "num_warps": 8}
SUM_BLOCK = 1024


@triton.jit
def _gate_up_act(X, W, IDS, A, H: tl.constexpr, WIDTH: tl.constexpr, K: tl.constexpr,
                 BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    ib = tl.program_id(1)
    e = tl.load(IDS + p).to(tl.int64)
    t = p // K
    offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < WIDTH
    base = W + e * (2 * WIDTH) * H
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_K):
        offs_h = h0 + tl.arange(0, BLOCK_K)
        mask_h = offs_h < H
        xv = tl.load(X + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        m2 = mask_i[:, None] & mask_h[None, :]
        wg = tl.load(base + offs_i[:, None] * H + offs_h[None, :], mask=m2, other=0.0)
        wu = tl.load(base + (WIDTH + offs_i[:, None]) * H + offs_h[None, :], mask=m2, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    dt = A.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(A + p * WIDTH + offs_i, (s * u).to(dt), mask=mask_i)


@triton.jit
def _down(A, W, IDS, RW, Y, H: tl.constexpr, WIDTH: tl.constexpr, BLOCK_O: tl.constexpr,
          BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    ob = tl.program_id(1)
    offs_o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < H
    e = tl.load(IDS + p).to(tl.int64)
    rw = tl.load(RW + p).to(tl.float32)
    base = W + e * H * WIDTH
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for i0 in range(0, WIDTH, BLOCK_K):
        offs_i = i0 + tl.arange(0, BLOCK_K)
        mask_i = offs_i < WIDTH
        a = tl.load(A + p * WIDTH + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        w = tl.load(base + offs_o[:, None] * WIDTH + offs_i[None, :],
                    mask=mask_o[:, None] & mask_i[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    dt = A.dtype.element_ty  # (the projection rounds to the activations' dtype; Y's is the
    # weighted product's: float32 where the router's weights are)
    tl.store(Y + p * H + offs_o, (acc.to(dt).to(tl.float32) * rw).to(Y.dtype.element_ty),
             mask=mask_o)


@triton.jit
def _sum_k(Y, OUT, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for kk in tl.static_range(K):  # in expert-slot order, in float32, rounded once
        total += tl.load(Y + (t * K + kk) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + t * H + offs, total.to(OUT.dtype.element_ty), mask=mask)


def run_gemv(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, gate_up_cfg: dict | None = None,
             down_cfg: dict | None = None) -> torch.Tensor:
    """The three launches (`moe_gemv`'s body; the launch shapes are arguments for the sweep)."""
    gu, dn = gate_up_cfg or GATE_UP, down_cfg or DOWN
    n, h = x.shape
    k = idx.shape[1]
    i = down.shape[2]
    x = x.contiguous()
    ids = idx.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    act = torch.empty((n * k, i), dtype=x.dtype, device=x.device)
    _gate_up_act[(n * k, triton.cdiv(i, gu["BLOCK_I"]))](
        x, gate_up, ids, act, H=h, WIDTH=i, K=k, BLOCK_I=gu["BLOCK_I"], BLOCK_K=gu["BLOCK_K"],
        num_warps=gu["num_warps"])
    y = torch.empty((n * k, h), dtype=torch.promote_types(x.dtype, weights.dtype),
                    device=x.device)
    _down[(n * k, triton.cdiv(h, dn["BLOCK_O"]))](
        act, down, ids, rw, y, H=h, WIDTH=i, BLOCK_O=dn["BLOCK_O"], BLOCK_K=dn["BLOCK_K"],
        num_warps=dn["num_warps"])
    out = torch.empty_like(x)
    _sum_k[(n, triton.cdiv(h, SUM_BLOCK))](y, out, H=h, K=k, BLOCK=SUM_BLOCK)
    return out


@torch.library.custom_op("layersplit::moe_gemv", mutates_args=())
def moe_gemv(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[r, j] * down[e] @ (silu(g) * u), (g, u) = gate_up[e] @ x[r], e = idx[r, j]:
    `grouped_experts` for rows `x` (n, H); `gate_up` (E, 2I, H), `down` (E, H, I)."""
    return run_gemv(x, weights, idx, gate_up, down)


@triton.jit
def _route(LOGITS, W, IDS, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr,
           NORM: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, E_POW2)
    valid = offs < E
    z = tl.load(LOGITS + t * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = z - tl.max(z, axis=0)
    ez = tl.where(valid, tl.exp(z), 0.0)
    p = ez / tl.sum(ez, axis=0)
    p = tl.where(valid, p, -1.0)
    slots = tl.arange(0, K)
    wv = tl.zeros([K], dtype=tl.float32)
    iv = tl.zeros([K], dtype=tl.int32)
    for kk in tl.static_range(K):  # descending, the lower id first among equals (as topk)
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, offs, E_POW2), axis=0)
        wv = tl.where(slots == kk, best, wv)
        iv = tl.where(slots == kk, pick, iv)
        p = tl.where(offs == pick, -2.0, p)
    if NORM:
        wv = wv / tl.sum(wv, axis=0)
    tl.store(W + t * K + slots, wv)
    tl.store(IDS + t * K + slots, iv.to(tl.int64))


@torch.library.custom_op("layersplit::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) float32, expert ids (n, k)) of router `logits` (n, E): `route`'s softmax,
    top k and renormalisation. k must be a power of two (Triton's ranges)."""
    n, e = logits.shape
    w = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    _route[(n,)](logits.contiguous(), w, ids, E=e, E_POW2=triton.next_power_of_2(e), K=top_k,
                 NORM=norm)
    return w, ids


@moe_route.register_fake
def _(logits, top_k, norm):
    n = logits.shape[0]
    return (logits.new_empty((n, top_k), dtype=torch.float32),
            logits.new_empty((n, top_k), dtype=torch.int64))


@moe_gemv.register_fake
def _(x, weights, idx, gate_up, down):
    return torch.empty_like(x)
