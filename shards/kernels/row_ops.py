"""The elementwise work between a dense layer's GEMMs, one Triton kernel each: the residual add
with the RMSNorm that reads the sum, and SiLU(gate) * up.

With these, a dense layer's decode step needs no torch.compile: q/k/v GEMM, the decode-attention
kernel, o_proj GEMM, add + norm, gate/up GEMM, SiLU * up, down GEMM, add + norm (the next
layer's input norm): 8 kernels, as inductor's code made of the same functions, but without
importing torch.compile's modules (~3 s of a shard's start on an H100) and without Dynamo's
trace of the stages at the first step (~1.6 s). Rounding follows eager torch (`h + x`,
`shards.fused.rms_norm`, `F.silu(g) * u`): the sum is rounded to the activations' dtype once, the norm is computed in float32 and rounded before the weight multiplies it, SiLU's
output is rounded before the product; only the order of the float32 sum of squares differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm(H, s_h, X, s_x, W, H_OUT, s_ho, N_OUT, s_no, d, eps,
                  HAS_X: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    dtype = H_OUT.dtype.element_ty
    h = tl.load(H + row * s_h + cols, mask=ok, other=0.0)
    if HAS_X:
        x = tl.load(X + row * s_x + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + x.to(tl.float32)).to(dtype)  # rounded once, as torch's add
        tl.store(H_OUT + row * s_ho + cols, h, mask=ok)
    if HAS_W:
        h32 = h.to(tl.float32)
        scale = tl.rsqrt(tl.sum(h32 * h32, axis=0) / d + eps)
        normed = (h32 * scale).to(dtype).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(N_OUT + row * s_no + cols, (w * normed).to(dtype), mask=ok)


@triton.jit
def _silu_mul(GU, s_gu, OUT, s_out, f, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < f
    dtype = OUT.dtype.element_ty
    g = tl.load(GU + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_gu + f + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu's output, rounded
    tl.store(OUT + row * s_out + cols, (act * u).to(dtype), mask=ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"row_ops: {name} must be (rows, width) with contiguous rows, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    return t


def _norm_launch(h: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    _rows(h, "h")
    n, d = h.shape
    h_out = torch.empty_like(h) if x is not None else h
    normed = torch.empty_like(h) if w is not None else None
    if x is not None and _rows(x, "x").shape != h.shape:
        raise ValueError(f"row_ops: x {tuple(x.shape)} does not match h {tuple(h.shape)}")
    if w is not None and (w.shape != (d,) or w.stride(0) != 1 or w.device != h.device):
        raise ValueError(f"row_ops: norm weight {tuple(w.shape)} (stride {w.stride()}, on "
                         f"{w.device}) is not a contiguous vector of width {d} on {h.device}")
    if n:
        block = triton.next_power_of_2(d)
        _add_rms_norm[(n,)](
            h, h.stride(0), h if x is None else x, h.stride(0) if x is None else x.stride(0),
            h if w is None else w, h_out, h_out.stride(0),
            h if normed is None else normed, 0 if normed is None else normed.stride(0),
            d, float(eps), HAS_X=x is not None, HAS_W=w is not None, BLOCK=block,
            num_warps=4 if block <= 2048 else 8)
    return h_out, normed


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + x, rms_norm(h + x, w, eps)) of (rows, width) activations; with `w` None only the
    sum (and None)."""
    return _norm_launch(h, x, w, eps)


def rms_norm_rows(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(h, w, eps) of (rows, width) activations."""
    return _norm_launch(h, None, w, eps)[1]


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u of the gate/up projection's (rows, 2 * f) output, g its first half."""
    _rows(gu, "gate/up")
    n, two_f = gu.shape
    if two_f % 2:
        raise ValueError(f"row_ops: gate/up width {two_f} is odd")
    f = two_f // 2
    out = torch.empty(n, f, dtype=gu.dtype, device=gu.device)
    if n:
        _silu_mul[(n, triton.cdiv(f, SILU_BLOCK))](gu, gu.stride(0), out, out.stride(0), f,
                                                   BLOCK=SILU_BLOCK, num_warps=4)
    return out
