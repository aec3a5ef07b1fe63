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
def _latent_row(i, A, s_a, NW, eps, COS, SIN, s_cs, WRITE, K, V, s_k, s_v, rank, rope, half,
                latent, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Step row i's latent row: `c` normed (kv_a_layernorm), `k_pe` rotated, both halves
    written at the row's pool index."""
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
    k_pe = _rope_pair(A + i * s_a + rank, rr, r_ok, COS + i * s_cs, SIN + i * s_cs, rope,
                      INTERLEAVE)
    j = rank + rr  # (the row's values past the latent `c`)
    tl.store(K + p * s_k + j, k_pe, mask=r_ok & (j < half))
    tl.store(V + p * s_v + j - half, k_pe, mask=r_ok & (j >= half))
    if 2 * half > latent:  # (an odd width: the row's last, padding value)
        one = tl.arange(0, 1)
        tl.store(V + p * s_v + latent - half + one, tl.zeros([1], dtype=dt))


@triton.jit
def _query_rope(i, hh, h_ok, QP, s_qpn, s_qph, QO, s_qon, s_qoh, COS, SIN, s_cs, rank, rope,
                BLOCK_R: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Step row i's `q_pe` of heads `hh` (a tile; `h_ok` which count) rotated into the query
    rows' last R values."""
    rr = tl.arange(0, BLOCK_R)
    ok = h_ok[:, None] & (rr < rope)[None, :]
    q_pe = _rope_pair(QP + i * s_qpn + hh[:, None] * s_qph, rr[None, :], ok, COS + i * s_cs,
                      SIN + i * s_cs, rope, INTERLEAVE)
    tl.store(QO + i * s_qon + hh[:, None] * s_qoh + rank + rr[None, :], q_pe, mask=ok)


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
    _latent_row(i, A, s_a, NW, eps, COS, SIN, s_cs, WRITE, K, V, s_k, s_v, rank, rope, half,
                latent, BLOCK_C, BLOCK_R, INTERLEAVE)
    hh = tl.arange(0, BLOCK_H)
    _query_rope(i, hh, hh < heads, QP, s_qpn, s_qph, QO, s_qon, s_qoh, COS, SIN, s_cs, rank,
                rope, BLOCK_R, INTERLEAVE)


def _rows_checked(name: str, a: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  q_pe: torch.Tensor, q_out: torch.Tensor) -> tuple[int, int, int, int]:
    """(rank, rope, heads, half) of `mla_rows`' operands, or a ValueError naming them."""
    width = a.shape[1]
    rank = norm_weight.shape[0]
    rope = width - rank
    half = k_pool.shape[-1]
    if a.stride(1) != 1 or q_pe.stride(2) != 1 or q_out.stride(2) != 1 or \
            cos.stride(1) != 1 or sin.stride() != cos.stride() or rope % 2 or \
            k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or 2 * half < width:
        raise ValueError(f"{name}: rows of {width} values (rank {rank}) into halves of "
                         f"{half}, with contiguous last dims, an even rotary")
    return rank, rope, q_pe.shape[1], half


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
    rank, rope, heads, half = _rows_checked("mla_rows", a, norm_weight, cos, sin, k_pool,
                                            v_pool, q_pe, q_out)
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
def _head_block(X, s_xn, s_xh, W, s_wh, s_wk, s_wn, Y, s_yn, s_yh, n, K, N,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr):
    """This program's block of `heads_matmul`: head program_id(0), outputs of block
    program_id(1), rows of block program_id(2)."""
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
    _head_block(X, s_xn, s_xh, W, s_wh, s_wk, s_wn, Y, s_yn, s_yh, n, K, N, BLOCK_M, BLOCK_K,
                BLOCK_N, IEEE)


@triton.jit
def _rows_and_queries(
    X, s_xn, s_xh, W, s_wh, s_wk, s_wn, Y, s_yn, s_yh, n, K, N,  # `_heads_matmul`'s, W = W_UK
    A, s_a, NW, eps, COS, SIN, s_cs, WRITE, KP, VP, s_k, s_v, QP, s_qpn, s_qph,  # `_mla_rows`'
    rank, rope, half, latent,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_heads_matmul` of q_nope by W_UK into the query rows (Y), and `_mla_rows` in the same
    launch: each head's first block of outputs also rotates that head's `q_pe` of its rows into
    Y, and head 0's writes its rows' latent rows (the attention kernel after it reads them)."""
    pdl_start(PDL)
    _head_block(X, s_xn, s_xh, W, s_wh, s_wk, s_wn, Y, s_yn, s_yh, n, K, N, BLOCK_M, BLOCK_K,
                BLOCK_N, IEEE)
    if tl.program_id(1) == 0:
        h = tl.program_id(0).to(tl.int64)
        hh = h + tl.arange(0, 1)
        for r in range(0, BLOCK_M):
            i = tl.program_id(2).to(tl.int64) * BLOCK_M + r
            if i < n:
                _query_rope(i, hh, hh == h, QP, s_qpn, s_qph, Y, s_yn, s_yh, COS, SIN, s_cs,
                            rank, rope, BLOCK_R, INTERLEAVE)
                if h == 0:
                    _latent_row(i, A, s_a, NW, eps, COS, SIN, s_cs, WRITE, KP, VP, s_k, s_v,
                                rank, rope, half, latent, BLOCK_C, BLOCK_R, INTERLEAVE)


def heads_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int = 64) -> None:
    """y[i, h] = x[i, h] @ w[h] for x (n, H, K), w (H, K, N) and y (n, H, N), any strides but
    the last dims of x and y (stride 1); float32 accumulation, rounded once to y's dtype.
    `block_n`: output values per program (fewer: more programs for a small N)."""
    grid, shape = _heads_launch("heads_matmul", x, w, y, block_n)
    _heads_matmul[grid](
        x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), w.stride(2),
        y, y.stride(0), y.stride(1), x.shape[0], x.shape[2], w.shape[2], **shape, num_warps=4,
        **pdl(x),
    )


def _heads_launch(name: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int,
                  wider: bool = False) -> tuple[tuple[int, int, int], dict]:
    """The grid and blocks of `heads_matmul`'s launch, or a ValueError naming its operands
    (`wider`: y's rows may be wider than N, the products written to their first N values)."""
    n, heads, k = x.shape
    nn_ = w.shape[2]
    if w.shape[:2] != (heads, k) or y.shape[:2] != (n, heads) or \
            (y.shape[2] < nn_ if wider else y.shape[2] != nn_) or \
            x.stride(2) != 1 or y.stride(2) != 1:
        raise ValueError(f"{name}: x {tuple(x.shape)}, w {tuple(w.shape)}, y "
                         f"{tuple(y.shape)}: (n, H, K) @ (H, K, N) -> (n, H, N), last dims "
                         "contiguous")
    block_m = 16 if n <= 16 else 32
    return ((heads, triton.cdiv(nn_, block_n), triton.cdiv(n, block_m)),
            {"BLOCK_M": block_m, "BLOCK_K": min(128, max(16, triton.next_power_of_2(k))),
             "BLOCK_N": max(16, min(block_n, triton.next_power_of_2(nn_))),
             "IEEE": x.dtype == torch.float32})


def rows_and_queries(
    a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, write: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
    q_pe: torch.Tensor, q_nope: torch.Tensor, w_uk: torch.Tensor, q_out: torch.Tensor,
    interleave: bool, block_n: int = 64,
) -> None:
    """`mla_rows(a, ..., q_pe, q_out, interleave)` and `heads_matmul(q_nope, w_uk,
    q_out[..., :rank])` in one launch (`_rows_and_queries`): the query rows whole, the latent
    rows in the pool."""
    n, width = a.shape
    rank, rope, heads, half = _rows_checked("rows_and_queries", a, norm_weight, cos, sin,
                                            k_pool, v_pool, q_pe, q_out)
    if w_uk.shape[2] != rank or q_out.shape[2] != width or q_pe.shape[:2] != (n, heads) or \
            q_nope.shape[:2] != (n, heads):
        raise ValueError(f"rows_and_queries: W_UK {tuple(w_uk.shape)} and query rows "
                         f"{tuple(q_out.shape)} do not fit latent rows of {width} (rank {rank})")
    grid, shape = _heads_launch("rows_and_queries", q_nope, w_uk, q_out, block_n, wider=True)
    _rows_and_queries[grid](
        q_nope, q_nope.stride(0), q_nope.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1),
        w_uk.stride(2), q_out, q_out.stride(0), q_out.stride(1), n, q_nope.shape[2], rank,
        a, a.stride(0), norm_weight, float(eps), cos, sin, cos.stride(0), write,
        k_pool, v_pool, k_pool.stride(0), v_pool.stride(0),
        q_pe, q_pe.stride(0), q_pe.stride(1), rank, rope, half, width, **shape,
        BLOCK_C=triton.next_power_of_2(rank), BLOCK_R=max(2, triton.next_power_of_2(rope)),
        INTERLEAVE=interleave, num_warps=4, **pdl(a),
    )
