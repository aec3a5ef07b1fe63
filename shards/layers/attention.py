"""Self-attention over the KV cache (GQA, optional q/k RMSNorm, q/k/v bias, sliding window,
attention sinks).

Shapes: n = tokens in this step, H = query heads, G = KV heads, D = head dim, T = keys attended.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import (
    first_line,
    fused_kernels_available,
    kernel_failed,
    try_kernel,
)
from layersplit.shards.kv_cache import KVCache
from layersplit.shards.layers.fused_linear import concat_linears
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.rotary import apply_rope
from layersplit.shards.layers.step import SegmentsRefused, StepInfo
from layersplit.shards.model_config import ModelConfig
from torch import nn

log = logging.getLogger(__name__)


def group_queries(q: torch.Tensor, g: int) -> torch.Tensor:
    """Queries (n, H, D) as (G, H/G * n, D): the query rows of each of the G KV heads, for
    `Attention._grouped`. (Inside the compiled decode step, `shards.fused`, this layout is
    written by the rotary's own kernel; eager, a verify step's several rows cost a copy.)"""
    n, h, d = q.shape
    return q.view(n, g, h // g, d).permute(1, 2, 0, 3).reshape(g, h // g * n, d)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of `scores` in float32, with, where `sinks` is given, one more
    logit per row (its head's sink, broadcast to `scores`' shape but its last dim, which is 1)
    that takes probability and is dropped (gpt-oss's attention sinks, as transformers')."""
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1)
    both = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]


def scores_f32(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The batched product q @ k (B, m, D) x (B, D, T) in float32 whatever their dtype: attention
    scores as flash attention (transformers' GPU path) and our decode kernels keep them.
    Rounded to bfloat16, a score of 20 moves by up to 0.06 (and again when scaled): the grouped
    decode paths then erred ~5x as much as SDPA (`tests/shards/test_attention.py`). On a GPU one
    cuBLAS call writes them in float32; elsewhere the operands are upcast first."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.bmm(q, k, out_dtype=torch.float32)
    return torch.bmm(q.float(), k.float())


# score elements (query rows x heads x keys) one block of `attend_sinks` computes at once
SINK_BLOCK = 1 << 26


def attend_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend` for a layer with attention sinks (n, H * D): the fused kernels (flash, cuDNN,
    SDPA's) take no sink, so the scores are computed as matmuls per KV head (GQA without
    repeating K/V) and softmaxed with the sinks (`sink_softmax`), in blocks of query rows of at
    most `SINK_BLOCK` scores (a long prefill chunk over a long prefix)."""
    n, h, d = q.shape
    t, g = keys.shape[:2]
    r = h // g
    k = keys.permute(1, 2, 0)[:, None]  # (G, 1, D, T)
    v = values.transpose(0, 1)[:, None]  # (G, 1, T, D)
    sink = sinks.view(g, r, 1, 1)
    rows = max(1, SINK_BLOCK // (h * t))
    outs = []
    for a in range(0, n, rows):
        qg = q[a:a + rows].view(-1, g, r, d).permute(1, 2, 0, 3)  # (G, r, m, D)
        scores = torch.matmul(qg, k) * scale  # (G, r, m, T)
        if mask is not None:
            scores = scores.masked_fill(~mask[a:a + rows], float("-inf"))
        probs = sink_softmax(scores, sink).to(values.dtype)
        outs.append(torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(-1, h * d))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def attend_batch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a batched step of S sequences of n rows (n = len(q) / len(keys): 1 for a
    batched decode step, more for a batched verify step): query row s * n + j (n, H, D rows; its
    H heads as G groups of H/G, no K/V repeated) attends keys[s] (T, G, D), its sequence's,
    under mask row s * n + j ((S * n, T) bool); scores and softmax in float32 (`scores_f32`).
    `sinks`: gpt-oss's per-head sink logits. Returns (S * n, H * D)."""
    s, t, g, d = keys.shape
    n, r = q.shape[0] // s, q.shape[1] // g
    qg = q.reshape(s, n, g, r, d).transpose(1, 2).reshape(s, g, n * r, d)  # (S, G, n*r, D)
    scores = scores_f32(qg.reshape(s * g, n * r, d), keys.permute(0, 2, 3, 1)
                        .reshape(s * g, d, t)).view(s, g, n * r, t) * scale
    seen = mask.view(s, 1, n, 1, t).expand(s, 1, n, r, t).reshape(s, 1, n * r, t)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sinks = sinks.view(1, g, 1, r).expand(s, g, n, r).reshape(s, g, n * r, 1)
    probs = sink_softmax(scores, sinks).to(values.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # (S, G, n*r, D)
    return out.view(s, g, n, r, d).transpose(1, 2).reshape(s * n, -1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, causal: bool, scale: float | None = None
           ) -> torch.Tensor:
    """SDPA of one sequence's n queries (n, H, D) over its keys and values (T, G, D). Returns
    (n, H * D).

    `causal`: `mask` is plain causal with the queries the last n of the T keys (an eager step's
    own mask): from position 0 (T == n) that is SDPA's `is_causal`, flash attention; for a chunk
    after the first, on a GPU, it is flash attention's own (lower-right) causal form
    (`_flash_lower_right`), or, where `LAYERSPLIT_CUDNN_PREFILL` asks for it, from a prefix of
    `CUDNN_MIN_PREFIX` keys, cuDNN's attention over the prefix and over the chunk, merged
    (`_cudnn_split`); with GQA, so a prefill chunk attends its cached prefix with no T-wide
    mask (and no copies of K/V where the flash op takes GQA). Else `mask` (n, T) or none. On a
    CPU the mask stays (its kernels are the exact path the tests compare).

    The fused kernels that take a mask do not take GQA (SDPA's fallback would materialize
    n x T scores per head), so a masked chunk after the first on a GPU repeats K/V per query
    head. One-row steps keep GQA (their scores are one row a head)."""
    n, h = q.shape[:2]
    t = keys.shape[0]
    from_start = causal and n == t and n > 1
    if causal and keys.is_cuda and 1 < n < t:
        out = (_cudnn_split(q, keys, values, scale) if CUDNN_MIN_PREFIX is not None and
               t - n >= CUDNN_MIN_PREFIX else None)
        if out is None:
            out = _flash_lower_right(q, keys, values, scale)
        if out is not None:
            return out.reshape(n, -1)
    gqa = h != keys.shape[1]
    if gqa and mask is not None and not from_start and keys.is_cuda and n > 1:
        r = h // keys.shape[1]
        keys, values = keys.repeat_interleave(r, dim=1), values.repeat_interleave(r, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, H, n, D)
        keys.transpose(0, 1)[None],  # (1, G, T, D)
        values.transpose(0, 1)[None],
        attn_mask=None if from_start else mask,
        is_causal=from_start,
        enable_gqa=gqa,
        scale=scale,
    )  # (1, H, n, D)
    return out[0].transpose(0, 1).reshape(n, -1)


def _fused_sdpa_takes(q: torch.Tensor) -> bool:
    """Whether the fused attention kernels (flash, cuDNN) take queries like `q`: 16-bit, head
    dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


CUDNN_SWITCH = "LAYERSPLIT_CUDNN_PREFILL"


def cudnn_min_prefix(value: str | None) -> int | None:
    """The cached keys from which a chunk takes `_cudnn_split`, from `CUDNN_SWITCH`'s value:
    unset, empty or 0, never (flash attention's lower-right form runs every chunk).

    Off by default: warm, on an H100, the split ran 1.7 x flash attention's speed at a 32K
    prefix (bench/prefill_attention.py, each shape timed after a first call), but torch builds
    a cuDNN graph for every distinct (chunk, prefix) length pair it meets, hundreds of ms each
    (pytorch/pytorch#155958, sgl-project/sglang#4650), and the Triton merge kernel compiles
    per alignment class of its lengths. A chat's chunks end at message boundaries, so their
    lengths almost never repeat: each chunk past the threshold would pay a build inside the
    request's time to its first token and inside the keep of each answer, as an H200 agent
    session (`bench/agent_session.py`) showed: 1-2K-token prefills of 0.4-2.5 s from a
    4,096-key prefix on, ~0.1 s below it. `bench/prefill_attention.py` prints
    the first call of each shape beside the warm ones."""
    if value is None or not value.strip():
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{CUDNN_SWITCH}={value!r}: must be a number of cached keys (0 or "
                         "unset: cuDNN's attention never runs a prefill chunk)")
    return n or None  # (any spelling of 0: off)


# cached keys from which a chunk takes `_cudnn_split`; None: never (`cudnn_min_prefix`)
CUDNN_MIN_PREFIX: int | None = cudnn_min_prefix(os.environ.get(CUDNN_SWITCH))
# what this process learnt of cuDNN's op: "gqa" -> whether it takes fewer K/V heads than query
# heads; a head dim -> whether it runs for it (absent: not yet known)
_CUDNN: dict[str | int, bool] = {}


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (1, H, n, D), natural log-sum-exp of each row's scores (1, H, n, 1)) of cuDNN's
    fused attention; `causal` is its upper-left form (here only over a square)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(*q.shape[:3], 1)


def _cudnn_split(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scale: float | None) -> torch.Tensor | None:
    """Causal attention of the last n of T positions (n < T) as two cuDNN attentions: the
    queries over the T - n keys before them (no mask: every query sees them all) and over their
    own n keys (causal, where upper-left and lower-right agree), merged by the two log-sum-exps.
    cuDNN's fused kernel has no lower-right causal form; split so, it runs a long prefix ~1.7 x
    faster than flash attention on an H100 (bench/prefill_attention.py). K/V with fewer heads
    (GQA) are passed as they are, never repeated. (n, H, D), or None where it does not run
    (dtype, head dim, GQA, a GPU without it, a failed call): the caller's flash path then runs.

    A first failure for a head dim or for GQA not yet seen to run marks it off for the process
    (GQA first, where the call had fewer K/V heads); a failure of what already ran (cuDNN's own
    workspace out of memory is a plain RuntimeError) costs only that call."""
    d = q.shape[-1]
    n, h = q.shape[:2]
    g, p = keys.shape[1], keys.shape[0] - n
    gqa = g != h
    if not _fused_sdpa_takes(q) or _CUDNN.get(d) is False or \
            (gqa and _CUDNN.get("gqa") is False):
        return None
    qh = q.transpose(0, 1)[None]
    kh, vh = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    try:
        o_own, l_own = _cudnn(qh, kh[:, :, p:], vh[:, :, p:], True, scale)
        _CUDNN.setdefault(d, True)  # it ran: a failure of the second call is that call's
        if gqa:
            _CUDNN.setdefault("gqa", True)
        o_pre, l_pre = _cudnn(qh, kh[:, :, :p], vh[:, :, :p], False, scale)
    except torch.cuda.OutOfMemoryError:  # (a RuntimeError too) the step fails as any other
        raise
    except RuntimeError as e:
        what = "gqa" if gqa and "gqa" not in _CUDNN else d if d not in _CUDNN else None
        if what is not None:
            _CUDNN[what] = False
        log.warning("cuDNN attention failed (%s) for a prefill chunk (head dim %d, %d query and "
                    "%d K/V heads); flash attention runs %s", first_line(e), d, h,
                    g, "this chunk" if what is None else
                    "from now on for " + ("GQA" if what == "gqa" else f"head dim {d}"))
        return None
    if d & (d - 1) == 0 and fused_kernels_available(q.device):  # one kernel, (n, H * D)
        from layersplit.shards.kernels.attention_merge import merge_attention

        return merge_attention(o_pre, l_pre, o_own, l_own).view(n, h, d)
    big = torch.maximum(l_pre, l_own)
    w_pre, w_own = torch.exp(l_pre - big), torch.exp(l_own - big)
    total = w_pre + w_own
    out = o_pre.float().mul_(w_pre / total).add_(o_own.float().mul_(w_own / total))
    return out.to(q.dtype)[0].transpose(0, 1)


_FLASH_GQA: dict[str, bool] = {}  # "gqa" -> whether the flash op took fewer K/V heads here


def _flash_lower_right(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scale: float | None) -> torch.Tensor | None:
    """Causal attention of the last n of T positions (n < T) through flash attention's own
    causal form, which aligns the queries with the last keys (what SDPA's `is_causal` does not
    do for n != T); K/V with fewer heads (GQA) as they are, where the op takes them (once
    found otherwise, they are repeated per query head). (n, H, D) or None where flash attention
    does not apply (dtype, head dim) or a call failed once GQA had run (only that call): the
    caller's mask path then runs."""
    if not _fused_sdpa_takes(q):
        return None
    h, g = q.shape[1], keys.shape[1]
    if g != h and not _FLASH_GQA.get("gqa", True):
        keys, values = (x.repeat_interleave(h // g, dim=1) for x in (keys, values))
    args = (q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            *args, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[0]
        if g != h:
            _FLASH_GQA.setdefault("gqa", True)
    except torch.cuda.OutOfMemoryError:  # (a RuntimeError too) not the op refusing GQA: the
        raise  # step fails as any out-of-memory step does, and GQA stays on for the next
    except RuntimeError:
        if g == h or "gqa" in _FLASH_GQA:  # (GQA ran before: not the op refusing it)
            return None
        _FLASH_GQA["gqa"] = False  # this build's flash op wants as many K/V heads as queries
        return _flash_lower_right(q, keys, values, scale)
    return out[0].transpose(0, 1)


class Attention(nn.Module):
    # graph steps (`StepInfo.grouped`) through the decode-attention kernel: set on a GPU by
    # `shards.fused` (its `kernel_attention`) for layers that run the torch path there
    graph_attention = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.window = cfg.window(layer)  # None: full causal attention
        self.scale = cfg.attn_scale or d ** -0.5  # score scale (Gemma: query_pre_attn_scalar)
        self.sdpa_scale = cfg.attn_scale  # None: SDPA's own 1/sqrt(D)
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, g * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, g * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # (H,) one logit per head that takes a share of each row's softmax (gpt-oss; set by the
        # family): such a layer attends through `attend_sinks` and the grouped matmuls below,
        # or the decode-attention kernel (`graph_attention`)
        self.sinks: nn.Parameter | None = None
        self.qkv_proj: nn.Linear | None = None  # set by `fuse_projections` (GPU)

    def fuse(self) -> None:
        """One matmul for q, k and v (fewer, larger kernels on a GPU); once."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h, g, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([h * d, g * d, g * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(n, h, d), k.view(n, g, d), v.view(n, g, d)

    def forward(
        self,
        x: torch.Tensor,  # (n, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        layer: int,
        slot: int,
        step: StepInfo,
    ) -> torch.Tensor:
        if step.parts:  # (several sequences' eager steps: `FusedDecode.prefill` takes them)
            raise SegmentsRefused("torch attention runs one sequence's eager step at a time")
        if self.graph_attention is not None and step.grouped and x.is_cuda \
                and cos.shape[-1] == self.head_dim and not kernel_failed("decode-attention"):
            # (a partial rotary is not the kernel's)
            eps = 1e-6 if self.q_norm is None else self.q_norm.eps
            out = try_kernel("decode-attention", self.graph_attention, self, self.qkv_proj(x),
                             cos, sin, kv, layer, slot, step, eps)
            if out is not None:
                return self.o_proj(out)
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step.lo is not None:  # a batched decode step: `slot` is unused
            keys, values = kv.append_batch(layer, step, k, v)  # (n, T, G, D) each
            return self.o_proj(self._grouped_batch(q, keys, values, step.mask_for(self.window)))
        mask = step.mask_for(self.window)
        keys, values = kv.append(layer, slot, step, k, v)  # (T, G, D) each
        if step.grouped:
            return self.o_proj(self._grouped(group_queries(q, self.num_kv_heads), keys, values,
                                             mask))
        if self.sinks is not None:
            return self.o_proj(attend_sinks(q, keys, values, mask, self.sinks, self.scale))
        # an eager step's own mask is plain causal: flash attention applies (a window's is not)
        causal = step.causal and mask is step.mask
        return self.o_proj(attend(q, keys, values, mask, causal, self.sdpa_scale))

    def _grouped(self, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """Decode attention (few queries, many keys) as two batched matmuls, for queries
        grouped by `group_queries`.

        GQA without repeating K/V: the H/G query heads of each KV head become extra query rows
        of that head. Plain matmuls beat the fused attention kernels at these shapes (a GPU
        profile showed 22 us per layer in cuDNN's flash kernel for 4 x 768 per head)."""
        g, d = self.num_kv_heads, self.head_dim
        r = self.num_heads // g
        n = qg.shape[1] // r
        scores = scores_f32(qg, keys.permute(1, 2, 0)) * self.scale  # (G, r*n, T)
        if mask is not None:
            scores = scores.masked_fill(~mask.repeat(r, 1), float("-inf"))
        sinks = None if self.sinks is None else \
            self.sinks.view(g, r, 1, 1).expand(g, r, n, 1).reshape(g, r * n, 1)
        probs = sink_softmax(scores, sinks).to(values.dtype)
        out = torch.matmul(probs, values.transpose(0, 1))  # (G, r*n, D)
        return out.view(g, r, n, d).permute(2, 0, 1, 3).reshape(n, -1)

    def _grouped_batch(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        return attend_batch(q, keys, values, mask, self.scale, self.sinks)
