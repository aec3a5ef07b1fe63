"""The pieces of a latent-attention step around its attention kernel (`mla_decode`), each one
Triton launch where the torch path takes several (`shards.layers.mla.MLAttention._kernel_step`):

- `mla_rows`: the step's latent rows written into the paged pool (kv_a_layernorm on `c`, the
  rotary on `k_pe`, both halves stored at the rows' pool indices) and the queries' rotary part
  (`q_pe` of every head) written into the query rows' last `rope` values. Replaces the norm, two
  rotaries (~5 kernels each), a cat and two `index_copy_` (11 launches, measured on an H200
  inside a captured step).
- `heads_matmul`: each head's row times its own matrix, `y[i, h] = x[i, h] @ W_h`, reading each
  head's matrix once for all rows: `q_nope W_UK` (the absorbed query) and `o_lat W_UV^T` (the
  heads' outputs), straight from `kv_b_proj`'s weight, into the layout the next step reads (no
  transposes, no layout copies).

Rounding follows the torch path op by op where it rounds (the norm's product, each rotary
product and their sum); matmuls accumulate in float32 and round once, as cuBLAS does. Device
tensors only: they run inside CUDA graphs. `tests/gpu/test_mla_kernel.py` compares the step with
the torch path (on a CPU through Triton's interpreter, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start


@triton.jit
def _rope_pair(X, j, ok, COS, SIN, rope, INTERLEAVE: tl.constexpr):
    """The rotary of values `j` (a tile of indices below `rope`) of the vectors at X (`X` a
    tile of row bases): the rotate-half layout (`layers.rotary.apply_rope`) or interleaved pairs
    (`layers.mla.apply_rope_interleaved`), rounded as torch rounds it (each product, then the
    sum, to X's dtype)."""
    half_r = rope // 2
    low = j < half_r
    if INTERLEAVE:
        f = j % half_r
        a = tl.load(X + 2 * f + tl.where(low, 0, 1), mask=ok, other=0.0)
        b = tl.load(X + 2 * f + tl.where(low, 1, 0), mask=ok, other=0.0)
    else:
        f = j
        a = tl.load(X + j, mask=ok, other=0.0)
        b = tl.load(X + tl.where(low, j + half_r, j - half_r), mask=ok, other=0.0)
    c = tl.load(COS + f, mask=ok, other=0.0)
    s = tl.load(SIN + f, mask=ok, other=0.0)
    dt = a.dtype
    t1 = (a.to(tl.float32) * c.to(tl.float32)).to(dt).to(tl.float32)
    t2 = (b.to(tl.float32) * s.to(tl.float32)).to(dt).to(tl.float32)
    return tl.where(low, t1 - t2, t1 + t2).to(dt)


@triton.jit
def _mla_rows(
    A, s_a,  # (n, C + R): kv_a_proj's output rows, [c, k_pe]
    NW, eps,  # (C,): kv_a_layernorm's weight
    COS, SIN, s_cs,  # (n, R) each: the rows' rotary tables
    WRITE,  # (n,) int64: the pool row each step row's latent row goes to
    K, V, s_k, s_v,  # the layer's pool: row p's halves at K + p * s_k, V + p * s_v
    QP, s_qpn, s_qph,  # q_pe of row i, head h at QP + i * s_qpn + h * s_qph (R values)
    QO, s_qon, s_qoh,  # the query rows: q_pe roped to QO + i * s_qon + h * s_qoh + rank
    heads, rank, rope, half, latent,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    i = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, BLOCK_C)
    c_ok = cc < rank
    x = tl.load(A + i * s_a + cc, mask=c_ok, other=0.0)
    dt = x.dtype
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / rank + eps)
    w = tl.load(NW + cc, mask=c_ok, other=0.0)
    c = (w.to(tl.float32) * (x32 * inv).to(dt).to(tl.float32)).to(dt)
    p = tl.load(WRITE + i)
    tl.store(K + p * s_k + cc, c, mask=c_ok & (cc < half))
    tl.store(V + p * s_v + cc - half, c, mask=c_ok & (cc >= half))
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < rope
    cos, sin = COS + i * s_cs, SIN + i * s_cs
    k_pe = _rope_pair(A + i * s_a + rank, rr, r_ok, cos, sin, rope, INTERLEAVE)
    j = rank + rr  # (the row's values past the latent `c`)
    tl.store(K + p * s_k + j, k_pe, mask=r_ok & (j < half))
    tl.store(V + p * s_v + j - half, k_pe, mask=r_ok & (j >= half))
    if 2 * half > latent:  # (an odd width: the row's last, padding value)
        one = tl.arange(0, 1)
        tl.store(V + p * s_v + latent - half + one, tl.zeros([1], dtype=dt))
    hh = tl.arange(0, BLOCK_H)
    ok = (hh[:, None] < heads) & r_ok[None, :]
    q_pe = _rope_pair(QP + i * s_qpn + hh[:, None] * s_qph, rr[None, :], ok, cos, sin, rope,
                      INTERLEAVE)
    tl.store(QO + i * s_qon + hh[:, None] * s_qoh + rank + rr[None, :], q_pe, mask=ok)


def mla_rows(
    a: torch.Tensor,  # (n, C + R): rows of stride 1 along the row
    norm_weight: torch.Tensor,  # (C,)
    eps: float,
    cos: torch.Tensor,  # (n, R)
    sin: torch.Tensor,
    write: torch.Tensor,  # (n,) int64 pool rows
    k_pool: torch.Tensor,  # (pool rows, half): the latent rows' first halves
    v_pool: torch.Tensor,  # (pool rows, half): their second halves
    q_pe: torch.Tensor,  # (n, H, R): the queries' rotary parts (any strides, last dim 1)
    q_out: torch.Tensor,  # (n, H, C + R): the query rows; their last R values written here
    interleave: bool,
) -> None:
    """Write the step's latent rows into the pool and the queries' rotary parts into `q_out`
    (see the module)."""
    n, width = a.shape
    rank = norm_weight.shape[0]
    rope = width - rank
    heads = q_pe.shape[1]
    half = k_pool.shape[-1]
    if a.stride(1) != 1 or q_pe.stride(2) != 1 or q_out.stride(2) != 1 or \
            cos.stride(1) != 1 or sin.stride() != cos.stride() or rope % 2 or \
            k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or 2 * half < width:
        raise ValueError(f"mla_rows: rows of {width} values (rank {rank}) into halves of "
                         f"{half}, with contiguous last dims, an even rotary")
    _mla_rows[(n,)](
        a, a.stride(0), norm_weight, float(eps), cos, sin, cos.stride(0), write,
        k_pool, v_pool, k_pool.stride(0), v_pool.stride(0),
        q_pe, q_pe.stride(0), q_pe.stride(1), q_out, q_out.stride(0), q_out.stride(1),
        heads, rank, rope, half, width,
        BLOCK_C=triton.next_power_of_2(rank), BLOCK_R=max(2, triton.next_power_of_2(rope)),
        BLOCK_H=triton.next_power_of_2(heads), INTERLEAVE=interleave, num_warps=4,
        **pdl(a),
    )


@triton.jit
def _heads_matmul(
    X, s_xn, s_xh,  # x[i, h, k] at X + i * s_xn + h * s_xh + k
    W, s_wh, s_wk, s_wn,  # W_h[k, j] at W + h * s_wh + k * s_wk + j * s_wn
    Y, s_yn, s_yh,  # y[i, h, j] at Y + i * s_yn + h * s_yh + j
    n, K, N,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    h = tl.program_id(0).to(tl.int64)
    jn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, j_ok = rows < n, jn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(X + rows[:, None] * s_xn + h * s_xh + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + h * s_wh + kk[:, None] * s_wk + jn[None, :] * s_wn,
                    mask=k_ok[:, None] & j_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(Y + rows[:, None] * s_yn + h * s_yh + jn[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & j_ok[None, :])


def heads_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int = 64) -> None:
    """y[i, h] = x[i, h] @ w[h] for x (n, H, K), w (H, K, N) and y (n, H, N), any strides but
    the last dims of x and y (stride 1); float32 accumulation, rounded once to y's dtype.
    `block_n`: output values per program (fewer: more programs for a small N)."""
    n, heads, k = x.shape
    nn_ = w.shape[2]
    if w.shape[:2] != (heads, k) or y.shape != (n, heads, nn_) or x.stride(2) != 1 or \
            y.stride(2) != 1:
        raise ValueError(f"heads_matmul: x {tuple(x.shape)}, w {tuple(w.shape)}, y "
                         f"{tuple(y.shape)}: (n, H, K) @ (H, K, N) -> (n, H, N), last dims "
                         "contiguous")
    block_m = 16 if n <= 16 else 32
    grid = (heads, triton.cdiv(nn_, block_n), triton.cdiv(n, block_m))
    _heads_matmul[grid](
        x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), w.stride(2),
        y, y.stride(0), y.stride(1), n, k, nn_,
        BLOCK_M=block_m, BLOCK_K=min(128, max(16, triton.next_power_of_2(k))),
        BLOCK_N=max(16, min(block_n, triton.next_power_of_2(nn_))),
        IEEE=x.dtype == torch.float32, num_warps=4,
        **pdl(x),
    )
