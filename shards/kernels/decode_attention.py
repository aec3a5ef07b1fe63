"""Decode attention in one Triton kernel: q/k RMSNorm, rotary, the KV write and attention.

Replaces, per layer of a captured decode step, the q/k-norm + rotary kernels, the two
`index_copy_` KV writes and the ~11 small kernels of `Attention._grouped` (two batched matmuls,
scale, `~mask.repeat`, masked_fill, casts, softmax, layout copies) with one launch, or two
when the keys are split (see below). Same math as `shards.fused.pre_attention` + `KVCache.append` +
`Attention._grouped` (or `append_batch` + `_grouped_batch`); the GPU tests compare them.

Input is the fused q/k/v projection of the step's rows, `qkv` (N, (H + 2G) * D), bias included.
The step holds S sequences of n rows each: one sequence of n rows (a decode step, n = 1, or a
verify chain/tree), or S sequences of one row (a batched step, sequence s in slot lo + s). One
program per (sequence, KV head, key split, tile of query rows):

1. it normalizes and rotates the K rows of its head and writes K and V to the cache rows
   `rows` (those that fall in its key split; a padding row's scratch row is past every split and
   is not written), then a barrier makes them visible to its own threads;
2. it normalizes and rotates the queries of the H/G heads that share its KV head (GQA without
   repeating K/V: they are extra query rows, n * H/G of them) and attends its keys in blocks
   with an online softmax, reading each K and V row once, under `mask` (S, n, T), the step's
   own `StepInfo.mask_for(window)`, so causal, sliding-window and tree semantics are exactly
   the torch path's.

With a paged cache (`shards.paged_kv`) the cache is one layer of the block pool, (blocks, block
rows, G, D), and `tables` (S, W) holds each sequence's block table: key t of sequence s is row
t % KB of block tables[s, t // KB] (KB: rows per block). Each program looks up the blocks of its
keys as it reads them; entries past a table's end name the scratch block, which the mask hides.

Every K/V row a program writes is read only by programs that write it too (same head, same
split): the query tiles of a split are programs of their own (a verify step's 32 rows x 3
heads a group are 3 tiles: one program looping over them read every key three times in turn),
and each writes the split's new rows before reading them, the same values as the others, so
whichever write a read sees holds the same bits and no ordering between programs is needed
(on an H200 a 32-row verify step of the default model's shape, 400 keys, went from 1.47 to
1.15 ms in one process, 2026-11-28). A program reads keys only up to the last row its sequence
writes in the step (no query sees past it), so a graph captured for a KV-length bucket costs a
step the keys it has, not the bucket's. Positions, rows and masks are device tensors: the kernel
runs inside CUDA graphs with no host sync. A block of keys costs a program one memory latency,
so the keys are split among enough programs to fill the GPU (`key_split`): each program writes
a partial result (unnormalized output, running max, sum) and a second kernel combines them
(flash-decoding).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from layersplit.shards.kernels.pdl import pdl, pdl_start

SPLIT_ENV = "LAYERSPLIT_ATTN_SPLIT_KEYS"  # keys per split (0: never split); unset: `key_split`
BLOCK_N = 64  # keys per block of the inner loop (`block_n`: 128 where that is faster)
# query rows (rows x heads of a group) per tile; more rows loop over tiles. 64-row tiles spill:
# on an H100 a 16-row verify step of Qwen3-8B's heads took 255 us a layer at 2K keys in one
# 64-row tile, 31 us in two 32-row tiles (either block size; bench/decode_attention_sweep.py
# --rows 16)
MAX_BLOCK_M = 32
# launch settings (`bench/decode_attention_sweep.py` measures them): programs per multiprocessor
# that `key_split` aims at, warps per program, pipeline stages of the key loop (None: Triton's).
# On an H100 at 128K keys (Qwen3-8B's heads, one row, 16-row blocks): 2 programs per SM and
# 128-key blocks read K/V at 2.8 TB/s, where 1 and 64 read at 1.7; 8 warps are ~40 % slower
# with 128-key blocks, 4 pipeline stages change nothing.
LAUNCH = {"per_sm": 2, "num_warps": 4, "num_stages": None}


# keys one program reads at most (without `split_keys`): a batched step's programs are many
# (sequences x KV heads), so filling the GPU asks for few splits, and one long sequence among
# short ones would leave each of its programs most of its keys: on an H100, 1 x 64K + 15 x 2K
# prompts decoding together ran at 41 ms a step, where 16 x 2K ran at 11 ms
MAX_SPLIT_KEYS = 4096
# split counts up to which the combine kernel is compiled per count; past them it loops over
# groups of this many (on an H100, a loop over groups of 8 added 1.4 us a layer at 8 splits
# against the unrolled loops, and a 64-split combine in groups of 8 was slow; groups of 32 were
# not measured)
STATIC_SPLITS = 32



# the sinks' logits in the scores' units (log2: the kernels exponentiate with exp2)
LOG2E = tl.constexpr(1.4426950408889634)


def block_n(head_dim: int, itemsize: int) -> int:
    """Keys per block of the loop: 128 for 16-bit K/V of heads up to 128 wide (measured), else
    `BLOCK_N` (float32 tiles of 128 keys do not fit in shared memory; wider 16-bit heads were
    not measured)."""
    return 128 if head_dim <= 128 and itemsize <= 2 else BLOCK_N


@triton.jit
def _attend(
    QKV, s_qkv,  # (N, (H + 2G) * D), row stride
    QNW, KNW, eps,  # q/k RMSNorm weights (D,) when HAS_NORM
    COS, SIN, s_cs,  # (N, D) each, row stride
    KC, VC, s_slot, s_row,  # this layer's cache (slots, rows, G, D), head stride D; paged:
    # (blocks, KB, G, D), s_slot the block stride
    ROWS,  # (N,) int64: the cache row that step row r writes (its position in its sequence)
    slot0,  # the slot of sequence 0; sequence s uses slot0 + s (unused when PAGED)
    TABLES, s_tab,  # PAGED: (S, W) int64 block tables, row stride
    MASK, s_mseq, s_mrow,  # uint8 (S, n, T): query row i of sequence s sees key t
    OUT, s_out,  # (N, H * D)
    PO, PML,  # partials when SPLIT: (S, G, splits, M_PAD, D) and (S, G, splits, M_PAD, 2)
    SINKS,  # (H,) float32 when HAS_SINKS: each head's sink logit (gpt-oss)
    T, keys_per_split, scale,
    NROWS: tl.constexpr, R: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, M_TILES: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    PAGED: tl.constexpr, KB: tl.constexpr, HAS_SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    s = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    sp = tl.program_id(2) // M_TILES  # the key split
    mt = tl.program_id(2) % M_TILES  # the query tile
    lo = sp * keys_per_split
    hi = tl.minimum(lo + keys_per_split, T)
    H: tl.constexpr = G * R
    HALF: tl.constexpr = D // 2
    dt = KC.dtype.element_ty
    d = tl.arange(0, D)
    d_rot = (d + HALF) % D  # rotate_half: [-x2, x1]
    sign = tl.where(d < HALF, -1.0, 1.0)
    if PAGED:
        cache = g * D
        tab = TABLES + s * s_tab
    else:
        cache = (slot0 + s) * s_slot + g * D
    if HAS_NORM:
        qw = tl.load(QNW + d).to(tl.float32)
        qw_r = tl.load(QNW + d_rot).to(tl.float32)
        kw = tl.load(KNW + d).to(tl.float32)
        kw_r = tl.load(KNW + d_rot).to(tl.float32)

    # 1. this head's new K/V rows, written where they fall in this program's keys
    i = tl.arange(0, BLOCK_I)
    row = s * NROWS + i
    dest = tl.load(ROWS + row, mask=i < NROWS, other=-1)
    # no query of the step sees a key past the last row it writes (a padding row's scratch
    # row, past the keys, writes nothing and sees nothing): the keys of the bucket beyond it
    # are not read, so a step costs the keys it has, whatever its graph's bucket
    hi = tl.minimum(hi, tl.max(tl.where(dest < T, dest, -1), 0) + 1)
    wr = ((i < NROWS) & (dest >= lo) & (dest < hi))[:, None]
    src = QKV + row[:, None] * s_qkv + (H + g) * D
    k = tl.load(src + d[None, :], mask=wr, other=0.0).to(tl.float32)
    k_r = tl.load(src + d_rot[None, :], mask=wr, other=0.0).to(tl.float32)
    if HAS_NORM:  # as `rms_norm`: normalized, rounded, times the weight, rounded
        inv = tl.rsqrt(tl.sum(k * k, 1) / D + eps)[:, None]
        k = ((k * inv).to(dt).to(tl.float32) * kw[None, :]).to(dt).to(tl.float32)
        k_r = ((k_r * inv).to(dt).to(tl.float32) * kw_r[None, :]).to(dt).to(tl.float32)
    cs = row[:, None] * s_cs + d[None, :]
    c = tl.load(COS + cs, mask=wr, other=0.0).to(tl.float32)
    sn = tl.load(SIN + cs, mask=wr, other=0.0).to(tl.float32)
    k = k * c + sign[None, :] * k_r * sn
    if PAGED:  # the row's block, from the sequence's table
        wr1 = (i < NROWS) & (dest >= lo) & (dest < hi)
        blk = tl.load(tab + tl.where(wr1, dest // KB, 0), mask=wr1, other=0)
        at = cache + (blk * s_slot + (dest % KB) * s_row)[:, None] + d[None, :]
    else:
        at = cache + dest[:, None] * s_row + d[None, :]
    tl.store(KC + at, k.to(dt), mask=wr)
    v = tl.load(src + G * D + d[None, :], mask=wr, other=0.0)
    tl.store(VC + at, v, mask=wr)
    tl.debug_barrier()  # the rows just written are read below by this program's threads

    # 2. the queries of the R heads of this group: tile mt of BLOCK_M (row, head) pairs
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = m // R
    head = g * R + m % R
    ok_m = qi < NROWS
    qrow = s * NROWS + qi
    src = QKV + qrow[:, None] * s_qkv + head[:, None] * D
    q = tl.load(src + d[None, :], mask=ok_m[:, None], other=0.0).to(tl.float32)
    q_r = tl.load(src + d_rot[None, :], mask=ok_m[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(q * q, 1) / D + eps)[:, None]
        q = ((q * inv).to(dt).to(tl.float32) * qw[None, :]).to(dt).to(tl.float32)
        q_r = ((q_r * inv).to(dt).to(tl.float32) * qw_r[None, :]).to(dt).to(tl.float32)
    cs = qrow[:, None] * s_cs + d[None, :]
    c = tl.load(COS + cs, mask=ok_m[:, None], other=0.0).to(tl.float32)
    sn = tl.load(SIN + cs, mask=ok_m[:, None], other=0.0).to(tl.float32)
    q = (q * c + sign[None, :] * q_r * sn).to(dt)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    vis_row = MASK + s * s_mseq + qi[:, None] * s_mrow
    for b in range(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)):
        t = lo + b * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_t = t < hi
        # K, V and the mask issued together: a block costs one memory latency, not three
        if PAGED:
            tb = tl.load(tab + tl.where(ok_t, t // KB, 0), mask=ok_t, other=0)
            key_at = cache + tb * s_slot + (t % KB) * s_row  # (BLOCK_N,)
        else:
            key_at = cache + t * s_row
        kt = tl.load(KC + key_at[None, :] + d[:, None], mask=ok_t[None, :],
                     other=0.0)  # (D, BLOCK_N)
        vt = tl.load(VC + key_at[:, None] + d[None, :], mask=ok_t[:, None],
                     other=0.0)  # (BLOCK_N, D)
        vis = tl.load(vis_row + t[None, :], mask=ok_m[:, None] & ok_t[None, :], other=0)
        if IEEE:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where(vis != 0, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(dt), vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dt), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if not SPLIT:
        if HAS_SINKS:  # the sink takes its share of the softmax and adds no value
            sk = tl.load(SINKS + head, mask=ok_m, other=0.0).to(tl.float32) * LOG2E
            m_f = tl.maximum(m_i, sk)
            a_f = tl.exp2(m_i - m_f)
            acc = acc * a_f[:, None]
            l_i = l_i * a_f + tl.exp2(sk - m_f)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = OUT + qrow[:, None] * s_out + head[:, None] * D + d[None, :]
        tl.store(dst, out.to(OUT.dtype.element_ty), mask=ok_m[:, None])
    else:
        # (the split count is the grid's, not a compile-time constant: a bucket's count
        # grows with its keys, and each constant would be a compile of its own)
        part = ((s * G + g) * (tl.num_programs(2) // M_TILES) + sp) * (M_TILES * BLOCK_M) + m
        tl.store(PO + part[:, None] * D + d[None, :], acc)
        tl.store(PML + part * 2, m_i)
        tl.store(PML + part * 2 + 1, l_i)


@triton.jit
def _combine(
    PO, PML, OUT, s_out, splits, SINKS,
    NROWS: tl.constexpr, R: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, M_TILES: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Merge the key splits' partial results of `_attend` (one program per sequence, KV head
    and query tile). `SPLITS`: `splits` where it is at most `STATIC_SPLITS` (its loops
    unrolled, a compile per count), else 0: a loop over groups of GROUP (a long context's
    bucket count grows with its keys, and compiling 256 unrolled splits takes minutes; each
    group costs a memory latency, so the groups are large)."""
    pdl_start(PDL)
    s = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    mt = tl.program_id(2)
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    qi = m // R
    ok_m = qi < NROWS
    first = (s * G + g) * splits * (M_TILES * BLOCK_M) + m
    big = tl.full([BLOCK_M], float("-inf"), tl.float32)
    num = tl.zeros([BLOCK_M, D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # (each head's sink logit, in the partials' log2 units)
        sk = tl.load(SINKS + g * R + m % R).to(tl.float32) * LOG2E
        big = sk
    if SPLITS > 0:  # a known count: every split's loads issued together
        for sp in tl.static_range(SPLITS):
            big = tl.maximum(big, tl.load(PML + (first + sp * M_TILES * BLOCK_M) * 2))
        big = tl.where(big == float("-inf"), 0.0, big)
        for sp in tl.static_range(SPLITS):
            part = first + sp * M_TILES * BLOCK_M
            w = tl.exp2(tl.load(PML + part * 2) - big)
            num += w[:, None] * tl.load(PO + part[:, None] * D + d[None, :])
            den += w * tl.load(PML + part * 2 + 1)
    else:  # many: in groups of GROUP (a split past the last adds nothing), one compile for all
        for base in range(0, splits, GROUP):
            for j in tl.static_range(GROUP):
                here = (m >= 0) & (base + j < splits)
                part = first + (base + j) * M_TILES * BLOCK_M
                big = tl.maximum(big, tl.load(PML + part * 2, mask=here, other=float("-inf")))
        big = tl.where(big == float("-inf"), 0.0, big)
        for base in range(0, splits, GROUP):
            for j in tl.static_range(GROUP):
                here = (m >= 0) & (base + j < splits)
                part = first + (base + j) * M_TILES * BLOCK_M
                w = tl.exp2(tl.load(PML + part * 2, mask=here, other=float("-inf")) - big)
                num += w[:, None] * tl.load(PO + part[:, None] * D + d[None, :],
                                            mask=here[:, None], other=0.0)
                den += w * tl.load(PML + part * 2 + 1, mask=here, other=0.0)
    if HAS_SINKS:
        den += tl.exp2(sk - big)
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    dst = OUT + (s * NROWS + qi)[:, None] * s_out + (g * R + m % R)[:, None] * D + d[None, :]
    tl.store(dst, out.to(OUT.dtype.element_ty), mask=ok_m[:, None])


def _launch() -> dict:
    out = {"num_warps": LAUNCH["num_warps"]}
    if LAUNCH["num_stages"] is not None:
        out["num_stages"] = LAUNCH["num_stages"]
    return out


_SMS: dict[torch.device, int] = {}


def _multiprocessors(device: torch.device) -> int:
    n = _SMS.get(device)
    if n is None:
        n = _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                            if device.type == "cuda" else 4)
    return n


def key_split(keys: int, programs: int, device: torch.device,
              split_keys: int | None = None, block: int = BLOCK_N,
              per_sm: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) for `keys` keys and `programs` programs per split.

    Each block of keys is one memory latency in a program's loop, so a step's keys are spread
    over enough programs to fill the GPU (at least one block each), and in splits of at most
    `MAX_SPLIT_KEYS` (the programs of sequences shorter than a split's start find no keys
    and end at once); `split_keys` (or
    `LAYERSPLIT_ATTN_SPLIT_KEYS`) fixes the keys per split instead, 0 for never. `block`: keys
    per block of the loop (a split holds whole blocks); `per_sm`: the programs an SM holds at
    once (`LAUNCH`'s, unless given), which the fill counts."""
    if split_keys is None and os.environ.get(SPLIT_ENV):
        split_keys = int(os.environ[SPLIT_ENV])
    blocks = -(-keys // block)
    if split_keys is None:  # fill the GPU, and spread the longest sequence's keys
        fill = (per_sm or LAUNCH["per_sm"]) * _multiprocessors(device) // programs
        splits = max(1, min(blocks, max(fill, -(-keys // MAX_SPLIT_KEYS))))
    else:
        splits = 1 if split_keys <= 0 else max(1, -(-keys // split_keys))
    per = -(-blocks // splits) * block  # whole blocks per split
    return -(-keys // per), per


def decode_attention(
    qkv: torch.Tensor,  # (N, (H + 2G) * D)
    cos: torch.Tensor,  # (N, D)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # (slots, rows, G, D): one layer of `KVCache.k_store`; paged:
    # (blocks, KB, G, D), one layer of `PagedKVCache.k_store`
    v_cache: torch.Tensor,
    rows: torch.Tensor,  # (N,) long: the cache row each step row writes
    slot0: int,  # the slot of sequence 0 (sequence s is in slot slot0 + s)
    mask: torch.Tensor,  # (S, n, T) or (N, T) bool: which keys each query row sees
    n_seqs: int,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    split_keys: int | None = None,
    tables: torch.Tensor | None = None,  # paged: (S, W) long, each sequence's block table
    sinks: torch.Tensor | None = None,  # (H,): each head's sink logit (gpt-oss)
    scale: float | None = None,  # the scores' scale (None: 1 / sqrt(D))
) -> torch.Tensor:
    """Attention output (N, H * D) of a step's rows; writes their K/V rows into the cache.
    `split_keys`: keys per program (0: one program per sequence and KV head; None: `key_split`
    decides). With `tables`, the cache is paged (see the module doc) and `slot0` unused. With
    `sinks`, each head's softmax has one more logit that takes probability and adds no value
    (`layers.attention.sink_softmax`)."""
    n_rows, width = qkv.shape
    _, _, g, d = k_cache.shape
    r = num_heads // g
    if width != (num_heads + 2 * g) * d or num_heads % g or d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention: qkv width {width} for {num_heads} heads, {g} KV "
                         f"heads of dim {d} (a power of two >= 16)")
    n = n_rows // n_seqs
    t = mask.shape[-1]
    kb = k_cache.shape[1]  # rows per slot, or per block (paged)
    rows_held = kb if tables is None else kb * tables.shape[-1]
    if t > rows_held or n_rows != n * n_seqs:
        raise ValueError(f"decode_attention: {t} keys or {n_rows} rows in {n_seqs} sequences "
                         f"do not fit a cache of {rows_held} rows")
    if tables is not None and (tables.dtype != torch.long or tables.dim() != 2 or
                               tables.shape[0] != n_seqs or tables.stride(1) != 1):
        raise ValueError(f"decode_attention: tables must be ({n_seqs}, W) int64 with contiguous "
                         f"rows, got {tables.dtype} {tuple(tables.shape)}")
    mask = mask.reshape(n_seqs, n, t).view(torch.uint8)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or mask.stride(2) != 1:
        raise ValueError("decode_attention: rows of qkv, cos, sin and mask must be contiguous")
    if k_cache.stride()[2:] != (d, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("decode_attention: K and V caches must share a (.., G, D) row layout")
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(n * r)))
    m_tiles = -(-n * r // block_m)
    bn = block_n(d, k_cache.element_size())
    splits, per = key_split(t, n_seqs * g * m_tiles, qkv.device, split_keys, bn)
    out = torch.empty(n_rows, num_heads * d, dtype=qkv.dtype, device=qkv.device)
    if splits > 1:
        m_pad = m_tiles * block_m
        po = torch.empty(n_seqs, g, splits, m_pad, d, dtype=torch.float32, device=qkv.device)
        pml = torch.empty(n_seqs, g, splits, m_pad, 2, dtype=torch.float32, device=qkv.device)
    else:
        po = pml = out  # unused
    has_norm = q_norm is not None
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"decode_attention: sinks must be a contiguous ({num_heads},) vector, "
                         f"got {tuple(sinks.shape)}")
    _attend[(n_seqs, g, splits * m_tiles)](
        qkv, qkv.stride(0),
        q_norm if has_norm else qkv, k_norm if has_norm else qkv, float(eps),
        cos, sin, cos.stride(0),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        rows, slot0,
        qkv if tables is None else tables, 0 if tables is None else tables.stride(0),
        mask, mask.stride(0), mask.stride(1),
        out, out.stride(0),
        po, pml, qkv if sinks is None else sinks,
        t, per, (d ** -0.5 if scale is None else scale) * math.log2(math.e),
        NROWS=n, R=r, G=g, D=d, BLOCK_M=block_m, M_TILES=m_tiles,
        BLOCK_I=max(2, triton.next_power_of_2(n)), BLOCK_N=bn, HAS_NORM=has_norm,
        SPLIT=splits > 1, IEEE=qkv.dtype == torch.float32, PAGED=tables is not None,
        KB=kb if tables is not None else 1, HAS_SINKS=sinks is not None, **_launch(),
        **pdl(qkv),
    )
    if splits > 1:
        _combine[(n_seqs, g, m_tiles)](
            po, pml, out, out.stride(0), splits, qkv if sinks is None else sinks, NROWS=n, R=r,
            G=g, D=d, BLOCK_M=block_m, M_TILES=m_tiles,
            SPLITS=splits if splits <= STATIC_SPLITS else 0, GROUP=STATIC_SPLITS,
            HAS_SINKS=sinks is not None, num_warps=4,
            **pdl(po),
        )
    return out
