"""The elementwise work of a hybrid (Qwen3.5, Qwen3-Next) layer's one-row decode step between
its GEMVs, one Triton kernel each: what `shards.fused_hybrid`'s GEMV step otherwise compiles
with torch.compile (`GEMV_STAGES` and `attn_pre`'s norms and rotary).

- `conv_gates`: the causal conv's step over the slot's conv state (float32 sum of products,
  rounded), its SiLU, the state after the row, and the gates (g = -exp(A_log) * softplus(a +
  dt_bias) in float32, beta = sigmoid(b)): `fused_hybrid.linear_conv`.
- `gated_norm`: the delta rule's output through the gated RMSNorm (`linear_gate`).
- `zc_rope_qk`: a gated-attention layer's q and k heads through their zero-centred norms and
  the partial rotary, read where the q/k/v projection left them (q interleaved with the output
  gate, head by head): `attn_pre` after its projection.
- `sigmoid_gate`: the attention output times sigmoid(gate), the gate read in place
  (`gate_output`).

With these (and `row_ops.rms_norm_rows` for the input norm), a one-row hybrid step needs no
torch.compile: no Dynamo trace of its stages at each start, no inductor compile at a machine's
first (`LAYERSPLIT_HYBRID_ROW_KERNELS`, on by default).

Rounding follows the compiled stages they replace, not torch's eager ops: inductor computes a
fused stage's elementwise work in float32 and rounds only what it stores, neither after each
bf16 op nor at the stage's own casts to the dtype (`.to(dtype)` followed by float32 work; its
default, `TORCHINDUCTOR_EMULATE_PRECISION_CASTS` unset): a
stage compiled was nearer its float64 result than one rounded there
(`tests/gpu/test_hybrid_row_ops.py`, H200). Rounded after each op, as eager torch and
`row_ops` round, the kernels answered worse: the Qwen3.5 shape's bfloat16 parity against
transformers float32 top-1 0.9271, mean KL 5.79e-3, against the compiled stages' 0.9444,
5.14e-3; rounded as the compiled stages, 0.9375, 5.15e-3 (H200, 2026-12-01). Only float32
sums' order differs from the compiled stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start


@triton.jit
def _conv_gates(P, s_p, S, s_sn, s_sc, s_sk, W, A_LOG, DT_BIAS, OUT, NEW, G, BETA,
                c, vd, hv, KW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                PDL: tl.constexpr = False):
    """Program (row, block of channels); the first block of each row also computes its gates.
    The conv's float32 sum goes into the SiLU unrounded."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < c
    dtype = OUT.dtype.element_ty
    x = tl.load(P + row * s_p + cols, mask=ok, other=0.0)
    new = NEW + row * c * (KW - 1) + cols * (KW - 1)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW - 1):  # (the state's columns, oldest first, then the row)
        sj = tl.load(S + row * s_sn + cols * s_sc + j * s_sk, mask=ok, other=0.0).to(dtype)
        acc += tl.load(W + cols * KW + j, mask=ok, other=0.0).to(tl.float32) * sj.to(tl.float32)
        if j > 0:
            tl.store(new + (j - 1), sj, mask=ok)
    acc += tl.load(W + cols * KW + (KW - 1), mask=ok, other=0.0).to(tl.float32) * \
        x.to(tl.float32)
    tl.store(new + (KW - 2), x, mask=ok)
    tl.store(OUT + row * c + cols, (acc / (1.0 + tl.exp(-acc))).to(dtype), mask=ok)
    if blk == 0:
        hs = tl.arange(0, BLOCK_H)
        hok = hs < hv
        b = tl.load(P + row * s_p + c + vd + hs, mask=hok, other=0.0).to(tl.float32)
        a = tl.load(P + row * s_p + c + vd + hv + hs, mask=hok, other=0.0).to(tl.float32)
        a = a + tl.load(DT_BIAS + hs, mask=hok, other=0.0).to(tl.float32)
        e = tl.exp(a)  # softplus: log1p(exp(a)), a past torch's threshold of 20 as it is
        u = 1.0 + e  # (log1p from log: exact where 1 + e rounds, e's own value where it is 1)
        softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
        decay = tl.exp(tl.load(A_LOG + hs, mask=hok, other=0.0).to(tl.float32))
        tl.store(G + row * hv + hs, -decay * softplus, mask=hok)
        tl.store(BETA + row * hv + hs, (1.0 / (1.0 + tl.exp(-b))).to(dtype), mask=hok)


@triton.jit
def _gated_norm(OUT_H, s_on, s_oh, Z, s_zn, s_zh, W, Y, dv, eps, BLOCK: tl.constexpr,
                PDL: tl.constexpr = False):
    """Program (row, value head): RMSNorm of the head's output, times the weight and SiLU(z),
    in float32, rounded once."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < dv
    dtype = Y.dtype.element_ty
    o = tl.load(OUT_H + row * s_on + head * s_oh + cols, mask=ok, other=0.0).to(tl.float32)
    normed = o * tl.rsqrt(tl.sum(o * o, axis=0) / dv + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(Z + row * s_zn + head * s_zh + cols, mask=ok, other=0.0).to(tl.float32)
    y = w * normed * (z / (1.0 + tl.exp(-z)))
    tl.store(Y + (row * tl.num_programs(1) + head) * dv + cols, y.to(dtype), mask=ok)


@triton.jit
def _zc_rope_qk(QKV, s_qkv, COS, SIN, s_cs, QN, KN, Q, K, nh, hd, r, eps,
                BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, head): heads [0, nh) the query's (at head * 2 hd of the row: q then its
    gate), the rest the key's (after the nh query-and-gate heads). The head's zero-centred
    RMSNorm (float32, times the float32 1 + w), then the rotary on its first r columns (x * cos
    + rotate_half(x) * sin), in float32, rounded once; the rest as normed, rounded."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < hd
    half = r // 2
    dtype = Q.dtype.element_ty
    if head < nh:
        src = QKV + row * s_qkv + head * 2 * hd
        wp = QN
    else:
        src = QKV + row * s_qkv + 2 * nh * hd + (head - nh) * hd
        wp = KN
    x32 = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hd + eps)
    x = x32 * scale * tl.load(wp + cols, mask=ok, other=0.0)
    rotated = cols < r
    partner = tl.where(cols < half, cols + half, cols - half)
    pok = ok & rotated
    xr32 = tl.load(src + partner, mask=pok, other=0.0).to(tl.float32)
    xr = xr32 * scale * tl.load(wp + partner, mask=pok, other=0.0)
    c = tl.load(COS + row * s_cs + cols, mask=pok, other=0.0).to(tl.float32)
    s = tl.load(SIN + row * s_cs + cols, mask=pok, other=0.0).to(tl.float32)
    rot = tl.where(cols < half, -xr, xr)
    out = tl.where(rotated, (x * c + rot * s).to(dtype), x.to(dtype))
    if head < nh:
        tl.store(Q + (row * nh + head) * hd + cols, out, mask=ok)
    else:
        ng = tl.num_programs(1) - nh
        tl.store(K + (row * ng + head - nh) * hd + cols, out, mask=ok)


@triton.jit
def _sigmoid_gate(A, s_a, QKV, s_qkv, OUT, hd, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, head): the head's attention output times sigmoid of its gate (the gate at
    head * 2 hd + hd of the q/k/v row) in float32, rounded once."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < hd
    dtype = OUT.dtype.element_ty
    a = tl.load(A + row * s_a + head * hd + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(QKV + row * s_qkv + head * 2 * hd + hd + cols, mask=ok, other=0.0)
    sig = 1.0 / (1.0 + tl.exp(-g.to(tl.float32)))
    tl.store(OUT + (row * tl.num_programs(1) + head) * hd + cols, (a * sig).to(dtype), mask=ok)


def _row_major(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"hybrid_row_ops: {name} must be (rows, width) with contiguous rows, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def conv_gates(p: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
               a_log: torch.Tensor, dt_bias: torch.Tensor, conv_dim: int, value_dim: int,
               hv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-projection's output `p` (n, C + Vd + 2 Hv: mixed q/k/v, z, b, a), the conv
    weight (C, K), the rows' conv states (n, C, K - 1) -> (the conv's SiLU output (n, C) in
    p's dtype, g (n, Hv) float32, beta (n, Hv), the conv states after the row (n, C, K - 1))."""
    _row_major(p, "p")
    n = p.shape[0]
    kw = conv_w.shape[1]
    if p.shape[1] != conv_dim + value_dim + 2 * hv or conv_w.shape[0] != conv_dim or kw < 2 or \
            not conv_w.is_contiguous() or conv_state.shape != (n, conv_dim, kw - 1):
        raise ValueError(f"hybrid_row_ops.conv_gates: p {tuple(p.shape)}, conv weight "
                         f"{tuple(conv_w.shape)} and states {tuple(conv_state.shape)} do not "
                         f"make a conv of {conv_dim} channels and {hv} value heads")
    out = torch.empty((n, conv_dim), dtype=p.dtype, device=p.device)
    new = torch.empty((n, conv_dim, kw - 1), dtype=p.dtype, device=p.device)
    g = torch.empty((n, hv), dtype=torch.float32, device=p.device)
    beta = torch.empty((n, hv), dtype=p.dtype, device=p.device)
    if n:
        block = 1024
        _conv_gates[(n, triton.cdiv(conv_dim, block))](
            p, p.stride(0), conv_state, *conv_state.stride(), conv_w, a_log, dt_bias, out, new,
            g, beta, conv_dim, value_dim, hv, KW=kw, BLOCK_C=block,
            BLOCK_H=triton.next_power_of_2(hv), num_warps=4, **pdl(p))
    return out, g, beta, new


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta rule's output `o` (n, 1, Hv, Dv) through the gated RMSNorm with gate `z` (n,
    1, Hv, Dv, any row stride): (n, Hv * Dv) in o's dtype."""
    n, rows, hv, dv = o.shape
    if rows != 1 or z.shape != o.shape or o.stride(3) != 1 or z.stride(3) != 1 or \
            w.shape != (dv,):
        raise ValueError(f"hybrid_row_ops.gated_norm: o {tuple(o.shape)} {o.stride()}, z "
                         f"{tuple(z.shape)} {z.stride()} and weight {tuple(w.shape)} differ")
    y = torch.empty((n, hv * dv), dtype=o.dtype, device=o.device)
    if n:
        _gated_norm[(n, hv)](o, o.stride(0), o.stride(2), z, z.stride(0), z.stride(2),
                             w.contiguous(), y, dv, float(eps),
                             BLOCK=triton.next_power_of_2(dv), num_warps=4, **pdl(o))
    return y


def zc_rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qn: torch.Tensor,
               kn: torch.Tensor, eps: float, nh: int, ng: int, hd: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated-attention layer's q/k/v projection output `qkv` (n, 2 nh hd + 2 ng hd) -> q (n,
    nh, hd) and k (n, ng, hd) through their zero-centred norms (`qn`, `kn`: float32 1 + w)
    and the rotary on their first R = cos.shape[1] columns."""
    _row_major(qkv, "qkv")
    n, r = qkv.shape[0], cos.shape[1]
    if qkv.shape[1] != 2 * nh * hd + 2 * ng * hd or cos.shape != sin.shape or \
            cos.shape[0] != n or r > hd or r % 2 or cos.stride(1) != 1 or \
            sin.stride() != cos.stride() or any(
                t.shape != (hd,) or t.dtype != torch.float32 or not t.is_contiguous()
                for t in (qn, kn)):
        raise ValueError(f"hybrid_row_ops.zc_rope_qk: qkv {tuple(qkv.shape)}, rotary "
                         f"{tuple(cos.shape)}, norm weights {tuple(qn.shape)} {qn.dtype} do "
                         f"not make {nh} query and {ng} key heads of {hd} (float32 weights)")
    q = torch.empty((n, nh, hd), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((n, ng, hd), dtype=qkv.dtype, device=qkv.device)
    if n:
        _zc_rope_qk[(n, nh + ng)](qkv, qkv.stride(0), cos, sin, cos.stride(0), qn, kn, q, k,
                                  nh, hd, r, float(eps), BLOCK=triton.next_power_of_2(hd),
                                  num_warps=4, **pdl(qkv))
    return q, k


def sigmoid_gate(attn: torch.Tensor, qkv: torch.Tensor, nh: int, hd: int) -> torch.Tensor:
    """The attention output (n, nh hd) times sigmoid of the output gate, read where the q/k/v
    projection left it (`qkv` (n, ...): head h's gate at h * 2 hd + hd)."""
    _row_major(attn, "attention output")
    _row_major(qkv, "qkv")
    n = attn.shape[0]
    if attn.shape != (n, nh * hd) or qkv.shape[0] != n or qkv.shape[1] < 2 * nh * hd:
        raise ValueError(f"hybrid_row_ops.sigmoid_gate: attention output {tuple(attn.shape)} "
                         f"and qkv {tuple(qkv.shape)} do not hold {nh} heads of {hd}")
    out = torch.empty_like(attn)
    if n:
        _sigmoid_gate[(n, nh)](attn, attn.stride(0), qkv, qkv.stride(0), out, hd,
                               BLOCK=triton.next_power_of_2(hd), num_warps=4, **pdl(attn))
    return out
