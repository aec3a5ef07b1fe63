"""Latent attention's absorbed form (`shards.layers.mla.MLAttention._absorbed`) as one Triton
kernel that reads the latent rows where the paged pool holds them, plus the combine of its key
splits (flash-decoding's second kernel).

The torch path gathers each sequence's attended rows out of the pool (a copy of T latent rows a
layer) and then reads them twice (scores, then the weighted sum). Here each program reads a
block of keys' latent rows once, straight from the pool through the row indices of the step
(`PagedKVCache.pool_index`), and uses each row for every query head at once (the heads share
the latent: MLA's whole point), with an online softmax:
    scores = q_c . c_t + q_pe . pe_t   (q_c = q_nope W_UK, kv_lora_rank wide; pe: the rope key)
    o_lat  = softmax(scores * scale) . c
The latent row of a key is `kv_lora_rank + qk_rope_head_dim` values stored as two halves (the
pool's K and V rows, `ModelConfig.kv_row`); value j of the row is K[j] below the half, V[j - half]
from it. W_UV is applied after (`mla_step.heads_matmul`), or, with `mla_decode`'s `w_uv`, in the
combine's launch (`_mla_combine_uv`).

Programs: (sequence, tile of query rows, key split). A sequence's query rows are its r step rows
times H heads (r = 1 in a decode step; a verify step's rows under their tree mask). Keys are
split among programs to fill the GPU (`decode_attention.key_split`, in whole runs of
`SPLIT_KEYS_ALONE` or `SPLIT_KEYS` keys); with one split a program writes its rows' output; with
more, each writes its partial (unnormalized sum, running max and sum of weights, in log2 units)
and `_mla_combine` merges them, a program per query row and run of the latent's columns, its
splits read up to `COMBINE["splits"]` at a load (each split's partial is rows x kv_lora_rank
floats, 8 MB in all at 32K keys, which loads of a split at a time read at a latency each). A
program reads keys only up to the last row its sequence writes in the step (`last`: no query
sees past it), so a graph captured for a bucket of keys costs a step the keys it has. Device
tensors only: it runs
inside CUDA graphs. `tests/gpu/test_mla_kernel.py` compares it with the torch path (on a CPU
through Triton's interpreter, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.decode_attention import key_split
from layersplit.shards.kernels.pdl import pdl, pdl_start

BLOCK_M = 16  # query rows (rows x heads) per tile; tl.dot needs 16
BLOCK_N = 32  # keys per block of the loop (16 for float32 rows: 32 of DeepSeek's 576-wide
# float32 latent rows, pipelined, asked 259,072 bytes of shared memory, past an H200's 232,448)
# keys a split reads at least: `key_split` spreads a step's keys over enough programs to fill
# the GPU in whole runs of these. Each block of keys is one memory latency in a program's loop,
# so a short context wants short splits; long contexts are split by the fill, each split writing
# a partial of rows x kv_lora_rank floats. SPLIT_KEYS_ALONE where a split is one program (one
# sequence whose query rows fit one tile: batch 1), SPLIT_KEYS otherwise. DeepSeek-V2-Lite width,
# H200, `bench/moe.py` (2026-11-30, processes in turn): splits of 16 / 32 / 64 keys, batch 1
# 404.7 / 394.4 / 389.2 tok/s, 8 streams 1,170.1 / 1,206.5 / 1,191.5. `bench/mla_attention.py
# --split-keys 16,32,64,128,256 --warps 4,8 --block-keys 16,64` (the whole attention stage of a
# layer at 256 / 2K / 32K keys, batch 1): 4 warps and blocks of 32 keys the best; at 32K keys the
# split sizes within 5 % of each other (the fill decides there)
SPLIT_KEYS = 32
SPLIT_KEYS_ALONE = 16
# launch shapes: the attention's warps per program (see SPLIT_KEYS); the combine's latent columns
# per program, splits whose partials one load reads (at most), warps
LAUNCH = {"num_warps": 4, "num_stages": None,  # (None: Triton's own)
          "per_sm": 2}  # programs an SM holds at once, for the fill of a long context's splits
# (218 registers a thread at 4 warps: two programs; `bench/mla_attention.py --per-sm`)
COMBINE = {"cols": 32, "splits": 256, "num_warps": 4}
OFF32_LIMIT = 2**31  # pools of fewer values than this are addressed in int32 offsets


@triton.jit
def _chunk(rows, key_ok, OFF: tl.constexpr, W: tl.constexpr, LEN: tl.constexpr):
    """Columns OFF .. OFF + W of a half (LEN wide) of each key's latent row: (BLOCK_N, W)."""
    cols = OFF + tl.arange(0, W)
    return tl.load(rows + cols[None, :], mask=key_ok[:, None] & (cols < LEN)[None, :],
                   other=0.0)


@triton.jit
def _q_chunk(qbase, row_ok, OFF: tl.constexpr, W: tl.constexpr, END: tl.constexpr):
    """The queries' columns OFF .. OFF + W (of their latent-row layout, END wide), transposed:
    (W, BLOCK_M)."""
    cols = OFF + tl.arange(0, W)
    return tl.load(qbase + cols[:, None], mask=(cols < END)[:, None] & row_ok[None, :],
                   other=0.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _store_cols(acc, dst, rows_ok, col0: tl.constexpr, W: tl.constexpr, FROM: tl.constexpr,
                TO: tl.constexpr, RANK: tl.constexpr):
    """acc (W, BLOCK_M) holds output columns col0 .. col0 + W; those in FROM .. TO below RANK
    are stored at dst + column (dst: (1, BLOCK_M) pointers)."""
    cols = col0 + tl.arange(0, W)
    ok = (cols >= FROM) & (cols < TO) & (cols < RANK)
    tl.store(dst + cols[:, None], acc.to(dst.dtype.element_ty),
             mask=ok[:, None] & rows_ok[None, :])


@triton.jit
def _mla_attend(
    Q, s_qs, s_qm,  # (S, M, C + R) queries in the latent row's layout: [q_c, q_pe]
    K, V, s_k, s_v,  # the layer's pool: row p's halves at K + p * s_k, V + p * s_v
    IDX, s_idx,  # (S, T) int64: the pool row of key t of sequence s
    MASK, s_mseq, s_mrow,  # uint8 (S, rows, T): step row i of sequence s sees key t
    LAST,  # (S, rows) int64: the sequence rows each step row writes (keys past the last unread)
    OUT, s_os, s_om,  # one split: the output (S, M, rank), normalized
    PO, PML,  # splits: partials (S, splits, m_pad, BLOCK_C) and (.., m_pad, 2): max and sum
    M, T, keys_per_split, scale, heads,
    RANK: tl.constexpr, LAT: tl.constexpr, HALF: tl.constexpr,  # kv_lora_rank, + rope, half
    K1: tl.constexpr, K2: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr,  # chunk widths
    HAS_K2: tl.constexpr, HAS_V2: tl.constexpr,  # (a half in one chunk: K2 / V2 unused)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_LAST: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, OFF32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Transposed, so that the keys are the dots' long side and the heads their short one: the
    scores (BLOCK_N keys x BLOCK_M query rows) are the key rows times the queries, and each
    output column block (latent columns x query rows) the key rows' columns times the weights.
    A key's latent row is read as it is stored, each half in two chunks of power-of-two widths
    (K1 + K2 = HALF wide, V1 + V2 the rest; DeepSeek's 288: 256 + 32), every chunk straight
    from its load into its dots. Compiled for sm_90 at DeepSeek's width, 4 warps: 218
    registers a thread, no spills, its loads pipelined; the first form (the queries as the
    dots' long side, whole rows read by two masked loads each) at 4 warps 255 and spills, so
    it ran at 8 warps (196), 73 us a layer at 32K keys against this form's 57."""
    pdl_start(PDL)
    s = tl.program_id(0).to(tl.int64)
    mt = tl.program_id(1)
    sp = tl.program_id(2)
    splits = tl.num_programs(2)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qbase = Q + s * s_qs + rows[None, :] * s_qm
    qk1 = _q_chunk(qbase, row_ok, 0, K1, HALF)
    qv1 = _q_chunk(qbase, row_ok, HALF, V1, LAT)
    if HAS_K2:
        qk2 = _q_chunk(qbase, row_ok, K1, K2, HALF)
    if HAS_V2:
        qv2 = _q_chunk(qbase, row_ok, HALF + V1, V2, LAT)
    step_row = rows // heads  # the step row each query row belongs to
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_k1 = tl.zeros([K1, BLOCK_M], tl.float32)
    acc_k2 = tl.zeros([K2, BLOCK_M], tl.float32)
    acc_v1 = tl.zeros([V1, BLOCK_M], tl.float32)
    acc_v2 = tl.zeros([V2, BLOCK_M], tl.float32)
    lo = sp * keys_per_split
    hi = tl.minimum(lo + keys_per_split, T)
    if HAS_LAST:
        n_rows = M // heads
        jr = tl.arange(0, BLOCK_ROWS)
        last = tl.max(tl.load(LAST + s * n_rows + jr, mask=jr < n_rows, other=0), 0)
        hi = tl.minimum(hi, tl.minimum(last + 1, T).to(tl.int32))  # (int32, as its bounds)
    for t0 in range(lo, hi, BLOCK_N):
        keys = t0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        pool = tl.load(IDX + s * s_idx + keys, mask=key_ok, other=0)
        if OFF32:  # (int32 row offsets: 10 registers a thread fewer than int64, sm_90)
            pool = pool.to(tl.int32)
        k_row, v_row = K + pool[:, None] * s_k, V + pool[:, None] * s_v
        k1 = _chunk(k_row, key_ok, 0, K1, HALF)
        sc = _dot(k1, qk1, IEEE)  # (N, M)
        v1 = _chunk(v_row, key_ok, 0, V1, LAT - HALF)
        sc += _dot(v1, qv1, IEEE)
        if HAS_K2:
            k2 = _chunk(k_row, key_ok, K1, K2, HALF)
            sc += _dot(k2, qk2, IEEE)
        if HAS_V2:
            v2 = _chunk(v_row, key_ok, V1, V2, LAT - HALF)
            sc += _dot(v2, qv2, IEEE)
        sc = sc * scale  # (log2 units: `scale` carries log2(e))
        seen = key_ok[:, None] & row_ok[None, :]
        if HAS_MASK:
            mk = tl.load(MASK + s * s_mseq + step_row[None, :] * s_mrow + keys[:, None],
                         mask=seen, other=0)
            seen = seen & (mk != 0)
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (rows that saw no key yet)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        pb = p.to(k1.dtype)
        acc_k1 = acc_k1 * alpha[None, :] + _dot(tl.trans(k1), pb, IEEE)
        if HAS_K2 and K1 < RANK:
            acc_k2 = acc_k2 * alpha[None, :] + _dot(tl.trans(k2), pb, IEEE)
        if HALF < RANK:
            acc_v1 = acc_v1 * alpha[None, :] + _dot(tl.trans(v1), pb, IEEE)
        if HAS_V2 and HALF + V1 < RANK:
            acc_v2 = acc_v2 * alpha[None, :] + _dot(tl.trans(v2), pb, IEEE)
        m_i = m_new
    if SPLIT:
        part = (s * splits + sp) * (tl.num_programs(1) * BLOCK_M) + rows
        dst = PO + part[None, :] * BLOCK_C
        tl.store(PML + part * 2, m_i)
        tl.store(PML + part * 2 + 1, l_i)
        ok = rows >= 0  # (every row of the tile: the partials are padded to whole tiles)
    else:
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        acc_k1 = acc_k1 * inv[None, :]
        acc_k2 = acc_k2 * inv[None, :]
        acc_v1 = acc_v1 * inv[None, :]
        acc_v2 = acc_v2 * inv[None, :]
        dst = OUT + s * s_os + rows[None, :] * s_om
        ok = row_ok
    _store_cols(acc_k1, dst, ok, 0, K1, 0, HALF, RANK)
    if HAS_K2 and K1 < RANK:
        _store_cols(acc_k2, dst, ok, K1, K2, 0, HALF, RANK)
    if HALF < RANK:
        _store_cols(acc_v1, dst, ok, HALF, V1, HALF, LAT, RANK)
    if HAS_V2 and HALF + V1 < RANK:
        _store_cols(acc_v2, dst, ok, HALF + V1, V2, HALF, LAT, RANK)


def _chunks(width: int) -> tuple[int, int, bool]:
    """A half's `width` columns as two chunks of power-of-two widths, at least 16 each (a
    dot's least): the largest that fits, then the rest; and whether there is a rest."""
    first = max(16, 1 << (width.bit_length() - 1))
    rest = width - first
    return first, max(16, triton.next_power_of_2(max(rest, 1))), rest > 0


@triton.jit
def _merged(PO, PML, first, m_pad, splits, cols, rank, BLOCK_C: tl.constexpr,
            BLOCK_S: tl.constexpr):
    """Columns `cols` of a query row's latent output, float32: its key splits' partials (the
    row's first at `first`, one every m_pad rows) each weighted by exp2(its max - the overall
    max), over the weighted sums of weights; BLOCK_S splits' columns a load."""
    sp = tl.arange(0, BLOCK_S)
    big = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    for base in range(0, splits, BLOCK_S):
        here = base + sp < splits
        part = first + (base + sp) * m_pad
        big = tl.maximum(big, tl.max(tl.load(PML + part * 2, mask=here, other=float("-inf")),
                                     0))
    big = tl.where(big == float("-inf"), 0.0, big)
    num = tl.zeros(cols.shape, tl.float32)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    for base in range(0, splits, BLOCK_S):
        here = base + sp < splits
        part = first + (base + sp) * m_pad
        w = tl.exp2(tl.load(PML + part * 2, mask=here, other=float("-inf")) - big)
        den += tl.sum(w * tl.load(PML + part * 2 + 1, mask=here, other=0.0), 0)
        num += tl.sum(w[:, None] * tl.load(PO + part[:, None] * BLOCK_C + cols[None, :],
                                           mask=here[:, None] & (cols < rank)[None, :],
                                           other=0.0), 0)
    return num / tl.where(den > 0, den, 1.0)


@triton.jit
def _mla_combine(
    PO, PML,  # `_mla_attend`'s partials: (S, splits, m_pad, BLOCK_C) and (.., m_pad, 2)
    OUT, s_os, s_om,  # (S, M, rank): the normalized output
    m_pad, splits, rank,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The key splits' partials merged, each weighted by exp2(its max - the overall max): one
    program per (sequence, latent columns, query row), each reading BLOCK_S splits' columns in
    one load (a long context's partials are rows x kv_lora_rank floats a split, 8 MB in all at
    32K keys; read a split at a time, each load one memory latency, they bound the step)."""
    pdl_start(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.program_id(2)
    out = _merged(PO, PML, s * splits * m_pad + row, m_pad, splits, d, rank, BLOCK_C,
                  BLOCK_S)
    tl.store(OUT + s * s_os + row * s_om + d, out.to(OUT.dtype.element_ty), mask=d < rank)


@triton.jit
def _mla_combine_uv(
    PO, PML,  # `_mla_attend`'s partials: (S, splits, m_pad, BLOCK_C) and (.., m_pad, 2)
    W, s_wh, s_wk, s_wn,  # W_UV^T: head h's (C, V) matrix's [c, j] at W + h s_wh + c s_wk + j s_wn
    OUT, s_os, s_om,  # (S, M, V): each query row's latent output times its head's W_UV
    m_pad, splits, rank, heads, V,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
    V_TILES: tl.constexpr, PDL: tl.constexpr = False,
):
    """`_mla_combine` of a query row's whole latent output, rounded to the output's dtype as it
    writes it, then times its head's W_UV (`mla_step.heads_matmul`'s product, float32 sums
    rounded once): program (sequence, query row, run of V_TILES tiles of BLOCK_V outputs),
    each merging its row's splits itself (from L2: a row's partials are read by each of its
    programs)."""
    pdl_start(PDL)
    s = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    h = (row % heads).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    o = _merged(PO, PML, s * splits * m_pad + row, m_pad, splits, c, rank, BLOCK_C, BLOCK_S)
    o = o.to(OUT.dtype.element_ty).to(tl.float32)
    wh = W + h * s_wh + c[None, :] * s_wk
    for t in tl.static_range(V_TILES):
        j = (tl.program_id(2) * V_TILES + t) * BLOCK_V + tl.arange(0, BLOCK_V)
        wt = tl.load(wh + j[:, None] * s_wn, mask=(j < V)[:, None] & (c < rank)[None, :],
                     other=0.0)
        y = tl.sum(wt.to(tl.float32) * o[None, :], 1)
        tl.store(OUT + s * s_os + row * s_om + j, y.to(OUT.dtype.element_ty), mask=j < V)


# the latent output's W_UV in the combine's launch (`LAYERSPLIT_MLA_COMBINE_UV=0`: apart):
# outputs a program's tile, tiles a program, and the most splits it takes (each of a
# row's V / (UV_TILE x UV_TILES) programs merges the row's splits again, a few KB each from L2
# at a short context's 16 splits; past UV_MAX_SPLITS the combine and `heads_matmul` run apart)
UV_TILE, UV_TILES, UV_MAX_SPLITS = 16, 1, 32


def mla_decode(
    q: torch.Tensor,  # (S, M, C + R): each sequence's query rows, [q W_UK, q_pe]
    k_pool: torch.Tensor,  # (pool rows, half): the latent rows' first halves
    v_pool: torch.Tensor,  # (pool rows, half): their second halves
    index: torch.Tensor,  # (S, T) int64: the pool row of each key of each sequence
    mask: torch.Tensor | None,  # (S * r, T) bool: step row i sees key t (r = M / heads / S)
    heads: int, rank: int, scale: float,
    last: torch.Tensor | None = None,  # (S * r,) int64: each step row's own row (key) index
    w_uv: torch.Tensor | None = None,  # (H, C, V): W_UV^T, each head's (`MLAttention._kv_b`)
) -> torch.Tensor:
    """The latent output (S, M, C), in q's dtype, of the absorbed attention (see the module);
    with `w_uv`, that output times each query row's head's W_UV, (S, M, V) (in the combine's
    launch where the keys are split in at most UV_MAX_SPLITS, `_mla_combine_uv`; else
    `mla_step.heads_matmul` after).
    `last`: the sequence rows the step writes (a program reads no key past its sequence's last;
    the mask still decides within)."""
    s, m, width = q.shape
    half, t = k_pool.shape[-1], index.shape[1]
    rows = m // heads  # step rows per sequence
    if q.stride(2) != 1 or index.stride(1) != 1 or (last is not None and (
            last.shape != (s * rows,) or last.stride(0) != 1)):
        raise ValueError(f"mla_decode: queries {tuple(q.shape)} and index {tuple(index.shape)} "
                         f"need contiguous rows, `last` ({s * rows},) contiguous")
    if not 0 < rank < width or not half < width <= 2 * half or \
            k_pool.shape[-1] != v_pool.shape[-1] or k_pool.stride(-1) != 1 or \
            v_pool.stride(-1) != 1:
        raise ValueError(f"mla_decode: a latent row of {width} values (rank {rank} and the "
                         f"rotary part) needs pool halves of {-(-width // 2)} contiguous values, "
                         f"not {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if w_uv is not None and (w_uv.dim() != 3 or w_uv.shape[:2] != (heads, rank)):
        raise ValueError(f"mla_decode: w_uv {tuple(w_uv.shape)} is not each of {heads} heads' "
                         f"(kv_lora_rank {rank}, V) W_UV^T")
    block_c = max(16, triton.next_power_of_2(rank))
    tiles = triton.cdiv(m, BLOCK_M)
    splits, per = key_split(t, s * tiles, q.device,
                            block=SPLIT_KEYS_ALONE if s * tiles == 1 else SPLIT_KEYS,
                            per_sm=LAUNCH["per_sm"])
    out = torch.empty(s, m, rank, dtype=q.dtype, device=q.device)
    if splits > 1:
        po = torch.empty(s, splits, tiles * BLOCK_M, block_c, dtype=torch.float32,
                         device=q.device)
        pml = torch.empty(s, splits, tiles * BLOCK_M, 2, dtype=torch.float32, device=q.device)
    else:
        po = pml = out  # (unused)
    if mask is None:
        mask_u8 = torch.empty(1, 1, 1, dtype=torch.uint8, device=q.device)
    else:
        mask_u8 = mask.reshape(s, rows, t)
        mask_u8 = (mask_u8.view(torch.uint8) if mask_u8.stride(2) == 1 else
                   mask_u8.to(torch.uint8).contiguous())
    k1, k2, has_k2 = _chunks(half)
    v1, v2, has_v2 = _chunks(width - half)
    _mla_attend[(s, tiles, splits)](
        q, q.stride(0), q.stride(1), k_pool, v_pool, k_pool.stride(0), v_pool.stride(0),
        index, index.stride(0), mask_u8, mask_u8.stride(0), mask_u8.stride(1),
        index if last is None else last, out, out.stride(0), out.stride(1), po, pml,
        m, t, per, scale * math.log2(math.e), heads, RANK=rank, LAT=width, HALF=half,
        K1=k1, K2=k2, V1=v1, V2=v2, HAS_K2=has_k2, HAS_V2=has_v2, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N if k_pool.element_size() <= 2 else BLOCK_N // 2, BLOCK_C=block_c,
        BLOCK_ROWS=max(2, triton.next_power_of_2(rows)), HAS_MASK=mask is not None,
        HAS_LAST=last is not None, SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
        OFF32=max(k_pool.shape[0] * k_pool.stride(0), v_pool.shape[0] * v_pool.stride(0))
        < OFF32_LIMIT, num_warps=LAUNCH["num_warps"],
        **({} if LAUNCH["num_stages"] is None else {"num_stages": LAUNCH["num_stages"]}), **pdl(q))
    block_s = min(COMBINE["splits"], triton.next_power_of_2(splits))
    if w_uv is not None and 1 < splits <= UV_MAX_SPLITS:
        v = w_uv.shape[2]
        uv = torch.empty(s, m, v, dtype=q.dtype, device=q.device)
        _mla_combine_uv[(s, m, triton.cdiv(v, UV_TILE * UV_TILES))](
            po, pml, w_uv, w_uv.stride(0), w_uv.stride(1), w_uv.stride(2), uv, uv.stride(0),
            uv.stride(1), tiles * BLOCK_M, splits, rank, heads, v, BLOCK_C=block_c,
            BLOCK_S=min(block_s, 16), BLOCK_V=UV_TILE, V_TILES=UV_TILES,
            num_warps=COMBINE["num_warps"], **pdl(po))
        return uv
    if splits > 1:
        cols = min(COMBINE["cols"], block_c)
        _mla_combine[(s, triton.cdiv(rank, cols), m)](
            po, pml, out, out.stride(0), out.stride(1), tiles * BLOCK_M, splits, rank,
            BLOCK_C=block_c, BLOCK_S=block_s, BLOCK_D=cols, num_warps=COMBINE["num_warps"],
            **pdl(po))
    if w_uv is None:
        return out
    from layersplit.shards.kernels.mla_step import heads_matmul

    uv = torch.empty(s, m, w_uv.shape[2], dtype=q.dtype, device=q.device)
    heads_matmul(out.view(s * rows, heads, rank), w_uv,
                 uv.view(s * rows, heads, w_uv.shape[2]), block_n=16)
    return uv
