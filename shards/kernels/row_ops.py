"""The elementwise work between a dense layer's GEMMs, one Triton kernel each: the residual add
with the RMSNorm that reads the sum, SiLU(gate) * up, and (for eager steps of many rows, whose
attention is flash attention's, not the decode kernel's) the q/k norm with the rotary.

With these, a dense layer's decode step needs no torch.compile: q/k/v GEMM, the decode-attention
kernel, o_proj GEMM, add + norm, gate/up GEMM, SiLU * up, down GEMM, add + norm (the next
layer's input norm): 8 kernels, as inductor's code made of the same functions, but without
importing torch.compile's modules (~3 s of a shard's start on an H100) and without Dynamo's
trace of the stages at the first step (~1.6 s). Rounding follows eager torch (`h + x`,
`shards.fused.rms_norm`, `F.silu(g) * u`): the sum is rounded to the activations' dtype once,
the norm is computed in float32 and rounded before the weight multiplies it, SiLU's output is
rounded before the product; only the order of the float32 sum of squares differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start

SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm(H, s_h, X, s_x, X2, s_x2, W, H_OUT, s_ho, N_OUT, s_no, d, eps,
                  HAS_X: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                  FLOAT_PRODUCT: tl.constexpr = False, FLOAT_SUM: tl.constexpr = False,
                  HAS_X2: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    dtype = H_OUT.dtype.element_ty
    h = tl.load(H + row * s_h + cols, mask=ok, other=0.0)
    h32 = h.to(tl.float32)
    if HAS_X:
        x = tl.load(X + row * s_x + cols, mask=ok, other=0.0)
        h32 = h32 + x.to(tl.float32)
        if HAS_X2:  # (h + x + x2 in float32)
            h32 = h32 + tl.load(X2 + row * s_x2 + cols, mask=ok, other=0.0).to(tl.float32)
        h = h32.to(dtype)  # (rounded once, as torch's add)
        tl.store(H_OUT + row * s_ho + cols, h, mask=ok)
        if not FLOAT_SUM:  # (the norm of the rounded sum, as eager torch; else the float32's)
            h32 = h.to(tl.float32)
    if HAS_W:
        scale = tl.rsqrt(tl.sum(h32 * h32, axis=0) / d + eps)
        normed = h32 * scale
        if not FLOAT_PRODUCT:  # (Llama rounds before the weight multiplies; gpt-oss after)
            normed = normed.to(dtype).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(N_OUT + row * s_no + cols, (w * normed).to(dtype), mask=ok)


@triton.jit
def _silu_mul(GU, s_gu, OUT, s_out, f, BLOCK: tl.constexpr, ROUND_ACT: tl.constexpr = True,
              PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < f
    dtype = OUT.dtype.element_ty
    g = tl.load(GU + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_gu + f + cols, mask=ok, other=0.0).to(tl.float32)
    act = g / (1.0 + tl.exp(-g))
    if ROUND_ACT:  # (F.silu's output, rounded, as eager torch rounds it)
        act = act.to(dtype).to(tl.float32)
    tl.store(OUT + row * s_out + cols, (act * u).to(dtype), mask=ok)


@triton.jit
def _rope_qk(QKV, s_qkv, COS, SIN, s_cs, QN, KN, Q, K, nh, d, eps, ROWS, K_POOL, V_POOL, s_pool,
             HAS_NORM: tl.constexpr, TO_POOL: tl.constexpr, BLOCK: tl.constexpr,
             PDL: tl.constexpr = False):
    """One head of one row: program (row, head), heads [0, nh) the query's, the rest the
    key's; each torch op's rounding is kept (norm as `RMSNorm`, then x * cos and
    rotate_half(x) * sin each rounded, and their sum). With `TO_POOL` a key head's program
    also stores the rotated key and the row's value head, as they are, at pool row ROWS[row]
    of K_POOL and V_POOL (rows of s_pool elements)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    half = d // 2
    dtype = Q.dtype.element_ty
    src = QKV + row * s_qkv + head * d
    x = tl.load(src + cols, mask=ok, other=0.0)
    partner = tl.where(cols < half, cols + half, cols - half)
    xr = tl.load(src + partner, mask=ok, other=0.0)
    if HAS_NORM:  # the head's RMSNorm (`shards.layers.norm.RMSNorm`): float32, cast, weight
        x32 = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(x32 * x32, axis=0) / d + eps)
        xr32 = xr.to(tl.float32)
        if head < nh:
            w = tl.load(QN + cols, mask=ok, other=0.0).to(tl.float32)
            wr = tl.load(QN + partner, mask=ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(KN + cols, mask=ok, other=0.0).to(tl.float32)
            wr = tl.load(KN + partner, mask=ok, other=0.0).to(tl.float32)
        x = (w * (x32 * scale).to(dtype).to(tl.float32)).to(dtype)
        xr = (wr * (xr32 * scale).to(dtype).to(tl.float32)).to(dtype)
    c = tl.load(COS + row * s_cs + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(SIN + row * s_cs + cols, mask=ok, other=0.0).to(tl.float32)
    rot = tl.where(cols < half, -xr.to(tl.float32), xr.to(tl.float32))
    a = (x.to(tl.float32) * c).to(dtype).to(tl.float32)
    b = (rot * s).to(dtype).to(tl.float32)
    out = (a + b).to(dtype)
    if head < nh:
        tl.store(Q + row * nh * d + head * d + cols, out, mask=ok)
    else:
        ng = tl.num_programs(1) - nh
        tl.store(K + row * ng * d + (head - nh) * d + cols, out, mask=ok)
        if TO_POOL:
            dst = tl.load(ROWS + row).to(tl.int64) * s_pool + (head - nh) * d
            tl.store(K_POOL + dst + cols, out, mask=ok)
            val = tl.load(src + ng * d + cols, mask=ok, other=0.0)  # (this head's value)
            tl.store(V_POOL + dst + cols, val, mask=ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"row_ops: {name} must be (rows, width) with contiguous rows, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    return t


def _norm_launch(h: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None,
                 eps: float, float_product: bool = False, float_sum: bool = False,
                 x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    _rows(h, "h")
    n, d = h.shape
    h_out = torch.empty_like(h) if x is not None else h
    normed = torch.empty_like(h) if w is not None else None
    if x is not None and _rows(x, "x").shape != h.shape:
        raise ValueError(f"row_ops: x {tuple(x.shape)} does not match h {tuple(h.shape)}")
    if x2 is not None and (x is None or _rows(x2, "x2").shape != h.shape):
        raise ValueError(f"row_ops: x2 {tuple(x2.shape)} needs an x, and h's shape "
                         f"{tuple(h.shape)}")
    if w is not None and (w.shape != (d,) or w.stride(0) != 1 or w.device != h.device):
        raise ValueError(f"row_ops: norm weight {tuple(w.shape)} (stride {w.stride()}, on "
                         f"{w.device}) is not a contiguous vector of width {d} on {h.device}")
    if n:
        block = triton.next_power_of_2(d)
        _add_rms_norm[(n,)](
            h, h.stride(0), h if x is None else x, h.stride(0) if x is None else x.stride(0),
            h if x2 is None else x2, h.stride(0) if x2 is None else x2.stride(0),
            h if w is None else w, h_out, h_out.stride(0),
            h if normed is None else normed, 0 if normed is None else normed.stride(0),
            d, float(eps), HAS_X=x is not None, HAS_W=w is not None, BLOCK=block,
            FLOAT_PRODUCT=float_product, FLOAT_SUM=float_sum, HAS_X2=x2 is not None,
            num_warps=4 if block <= 2048 else 8, **pdl(h))
    return h_out, normed


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None,
                 eps: float, float_product: bool = False, float_sum: bool = False,
                 x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + x, rms_norm(h + x, w, eps)) of (rows, width) activations; with `w` None only the
    sum (and None); `float_product` as `rms_norm_rows`'s; `float_sum`: the norm of the
    float32 sum, not of the sum rounded; `x2`: h + x + x2 summed in float32, rounded once
    (`float_sum` and `x2`: as a compiled stage computes them, `hybrid_row_ops` says why)."""
    return _norm_launch(h, x, w, eps, float_product, float_sum, x2)


def rms_norm_rows(h: torch.Tensor, w: torch.Tensor, eps: float,
                  float_product: bool = False) -> torch.Tensor:
    """rms_norm(h, w, eps) of (rows, width) activations; `float_product`: the weight
    multiplies the float32 norm before it is rounded (`layers.norm.FloatProductRMSNorm`)."""
    return _norm_launch(h, None, w, eps, float_product)[1]


def silu_mul(gu: torch.Tensor, round_act: bool = True) -> torch.Tensor:
    """SiLU(g) * u of the gate/up projection's (rows, 2 * f) output, g its first half: SiLU's
    output rounded to gu's dtype before the product, as eager torch rounds it, or with
    `round_act` False the product of the float32 SiLU, rounded once, as a compiled stage
    computes it (`hybrid_row_ops` says why that matters)."""
    _rows(gu, "gate/up")
    n, two_f = gu.shape
    if two_f % 2:
        raise ValueError(f"row_ops: gate/up width {two_f} is odd")
    f = two_f // 2
    out = torch.empty(n, f, dtype=gu.dtype, device=gu.device)
    if n:
        _silu_mul[(n, triton.cdiv(f, SILU_BLOCK))](gu, gu.stride(0), out, out.stride(0), f,
                                                   BLOCK=SILU_BLOCK, ROUND_ACT=round_act,
                                                   num_warps=4, **pdl(gu))
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, ng: int,
            qn_w: torch.Tensor | None = None, kn_w: torch.Tensor | None = None,
            eps: float = 0.0,
            pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated queries (n, nh, D) and keys (n, ng, D) of a fused q/k/v projection's output
    (n, (nh + 2 ng) D), each head first normalized by `qn_w` / `kn_w` when given (q/k norm),
    as `Attention.forward` computes them in torch (`apply_rope` over cos, sin (n, D)).

    `pool`: (K rows, V rows, rows): a layer's KV pool tensors (pool rows, ng, D), contiguous,
    and the (n,) long pool row of each of the step's rows: each row's rotated keys and its
    values (the projection's last ng heads) are stored there too, as `index_copy_` would
    store them (`PagedKVCache.append`), in the same launch."""
    _rows(qkv, "qkv")
    n, width = qkv.shape
    if width % (nh + 2 * ng):
        raise ValueError(f"row_ops: qkv width {width} is not {nh} + 2 x {ng} heads")
    d = width // (nh + 2 * ng)
    if d % 2 or cos.shape != (n, d) or sin.shape != (n, d) or cos.stride() != sin.stride() \
            or cos.stride(1) != 1:
        raise ValueError(f"row_ops: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} do not match "
                         f"{n} rows of head dim {d} (even, contiguous rows)")
    if (qn_w is None) != (kn_w is None) or any(
            w is not None and (w.shape != (d,) or w.stride(0) != 1) for w in (qn_w, kn_w)):
        raise ValueError("row_ops: the q and k norm weights must both be contiguous vectors of "
                         f"the head dim {d}, or both None")
    if pool is not None:
        _pool_check(pool, n, ng, d, qkv)
    q = torch.empty(n, nh, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, ng, d, dtype=qkv.dtype, device=qkv.device)
    k_pool, v_pool, rows = (qkv, qkv, qkv) if pool is None else pool
    if n:
        _rope_qk[(n, nh + ng)](qkv, qkv.stride(0), cos, sin, cos.stride(0),
                               qkv if qn_w is None else qn_w, qkv if kn_w is None else kn_w,
                               q, k, nh, d, float(eps), rows, k_pool, v_pool, ng * d,
                               HAS_NORM=qn_w is not None, TO_POOL=pool is not None,
                               BLOCK=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2,
                               enable_fp_fusion=False,  # (x * cos + rot * sin: two roundings)
                               **pdl(qkv))
    return q, k


def _pool_check(pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, ng: int, d: int,
                qkv: torch.Tensor) -> None:
    """`rope_qk`'s `pool` operands, or a ValueError naming what is wrong."""
    k_pool, v_pool, rows = pool
    for name, t in (("K", k_pool), ("V", v_pool)):
        if t.dim() != 3 or t.shape[1:] != (ng, d) or not t.is_contiguous() or \
                t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"row_ops: the {name} pool {tuple(t.shape)} ({t.dtype}, on "
                             f"{t.device}) is not contiguous rows of ({ng}, {d}) in "
                             f"{qkv.dtype} on {qkv.device}")
    if rows.shape != (n,) or rows.dtype != torch.long or rows.device != qkv.device:
        raise ValueError(f"row_ops: pool rows {tuple(rows.shape)} ({rows.dtype}) are not the "
                         f"{n} long pool rows of the step's rows on {qkv.device}")
