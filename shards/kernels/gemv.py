"""One-row projections of a dense layer's decode step as Triton GEMV kernels, with the work
around them folded in, so that a layer is 6 kernels instead of 9.

At batch 1 each projection reads its whole weight once for one row: cuBLAS's GEMV does that
near the memory's bandwidth, but the elementwise kernels between the projections (the residual
adds with their RMSNorms, SiLU * up) are each a launch and a drain of the GPU: ~2-4 us a kernel
inside a CUDA graph, ~0.1 ms a token on a 30-layer model. Here:

- `gemv(x, w, norm=(nw, eps))`: the input's RMSNorm as the GEMV's prologue (every program
  computes the row's scale itself: the row is a few KB, read from L2);
- `gemv(..., gate_up=True)`: the fused gate/up weight's two halves in one program each block of
  rows, SiLU(g) * u as the epilogue;
- `gemv(..., residual=r)`: the residual add as the epilogue.

So the step is: q/k/v (norm prologue), decode attention and its merge, o_proj (+ residual),
gate/up (norm prologue, SiLU * up), down (+ residual); the next layer's q/k/v normalizes its own
input. Roundings follow eager torch as `row_ops` does (the norm rounded before its weight
multiplies it, the projection's output rounded before the residual add and before SiLU);
only the order of the float32 sums differs from cuBLAS's.

Launch shapes (`config`) were measured on an H200 (`bench/gemv_sweep.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(X, NW, W, B, R, Y, N, K, eps,
          NORM: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, SILU: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dt = X.dtype.element_ty  # (Y may be wider: the rounded result is stored in it)
    if NORM:  # the row's RMSNorm scale, as `fused.rms_norm` (float32 mean of squares)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                xs = tl.load(X + offs_k).to(tl.float32)
            else:
                xs = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            sq += xs * xs
        scale = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU:
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    rows = W + offs_n[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + offs_k).to(tl.float32)
        else:
            x = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        if NORM:  # w * bf16(x * scale), rounded: `fused.rms_norm`
            if EVEN_K:
                nw = tl.load(NW + offs_k).to(tl.float32)
            else:
                nw = tl.load(NW + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            x = (nw * (x * scale).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if EVEN_K:
            m = mask_n[:, None]
        else:
            m = mask_n[:, None] & (offs_k < K)[None, :]
        w = tl.load(rows + offs_k[None, :], mask=m, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if SILU:  # the up half: rows N + offs_n of the fused weight
            wu = tl.load(rows + N * K + offs_k[None, :], mask=m, other=0.0)
            acc_u += wu.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_B:  # (cuBLAS adds the bias before its one rounding)
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = y.to(dt)
    if SILU:  # F.silu(g) * u, each rounded as torch's ops
        g = y.to(tl.float32)
        u = tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (s * u).to(dt)
    if HAS_R:  # h + F.linear(...): the projection rounded, then the sum
        r = tl.load(R + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dt)
    tl.store(Y + offs_n, y, mask=mask_n)


def config(k: int, *, norm: bool = False, gate_up: bool = False, head: bool = False) -> dict:
    """The launch shape for a weight of k inputs, from `bench/gemv_sweep.py` on an H200 at
    the default model's and the Llama-8B shapes (k = 576 .. 12288): few rows a program (one or
    two weight rows) and one or two warps fill the GPU with small programs, which keeps the
    most loads in flight; a row of up to 1024 is one block (masked), and with the norm's
    prologue wide blocks amortise it."""
    whole = triton.next_power_of_2(k)
    if gate_up:  # (a gate row and an up row a program)
        return {"BLOCK_N": 1, "BLOCK_K": whole if k <= 1024 else 512,
                "num_warps": 1 if k <= 1024 else 4}
    if head:
        return {"BLOCK_N": 4, "BLOCK_K": 128 if k <= 1024 else 256, "num_warps": 1}
    if k <= 1024:
        return {"BLOCK_N": 2, "BLOCK_K": whole, "num_warps": 4}
    if norm:
        return {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4}
    return {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1}


def gemv(x: torch.Tensor, w: torch.Tensor, *, bias: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
         gate_up: bool = False, out_dtype: torch.dtype | None = None, head: bool = False,
         cfg: dict | None = None) -> torch.Tensor:
    """F.linear of one row `x` (1, K) by `w` (N, K), with `norm` = (weight, eps): the row's
    RMSNorm first; `gate_up`: w is the fused (2F, K) gate/up weight and the result SiLU(g) * u
    (1, F); `residual` (1, N): added to the result. Returns a new (1, N or F) tensor, rounded
    to x's dtype and stored as `out_dtype` (default x's). `head`: the weight is a vocabulary's
    (its launch shape); `cfg`: a launch shape other than `config`'s."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv: x must be one contiguous row (1, K), got {tuple(x.shape)}")
    n, k = w.shape
    if x.shape[1] != k or w.stride() != (k, 1) or w.dtype != x.dtype:
        raise ValueError(f"gemv: weight {tuple(w.shape)} {w.dtype} (strides {w.stride()}) does "
                         f"not take a row of {x.shape[1]} {x.dtype} (contiguous rows)")
    if gate_up:
        if n % 2 or bias is not None:
            raise ValueError(f"gemv: a gate/up weight has an even row count and no bias, got "
                             f"{n} rows{' and a bias' if bias is not None else ''}")
        n //= 2
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} is not a contiguous vector of {n}")
    if residual is not None and (residual.shape != (1, n) or residual.stride(1) != 1):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} is not one row of {n}")
    if norm is not None and (norm[0].shape != (k,) or norm[0].stride(0) != 1):
        raise ValueError(f"gemv: norm weight {tuple(norm[0].shape)} is not a contiguous vector "
                         f"of {k}")
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    c = dict(cfg or config(k, norm=norm is not None, gate_up=gate_up, head=head))
    block_n = c.pop("BLOCK_N")
    block_k = c.pop("BLOCK_K")
    _gemv[(triton.cdiv(n, block_n),)](
        x, x if norm is None else norm[0], w, x if bias is None else bias,
        x if residual is None else residual, y, n, k, 0.0 if norm is None else float(norm[1]),
        NORM=norm is not None, HAS_B=bias is not None, HAS_R=residual is not None,
        SILU=gate_up, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, **c)
    return y
