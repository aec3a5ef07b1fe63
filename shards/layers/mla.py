"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a cache of latent rows.

Each token's keys and values are compressed to one latent: `c` (kv_lora_rank values, RMS-normed)
and a rotary key `k_pe` (qk_rope_head_dim values) shared by all heads. The KV cache holds that
latent row (`ModelConfig.kv_row`: its two halves in the cache's K and V tensors), never per-head
keys and values. Heads expand it through `kv_b_proj` = [W_UK; W_UV] per head:
    k_h = [W_UK_h c, k_pe],  v_h = W_UV_h c.
Two exact forms of the same attention:
- decompressed (prefill chunks): expand the attended latents into per-head K/V, then SDPA;
- absorbed (decode, verify and batched steps), as vLLM and SGLang run it: fold W_UK into the
  query (q_h W_UK_h, kv_lora_rank wide), score it against the latents themselves plus q_pe
  against k_pe, weight the latents by the probabilities and apply W_UV after. One step reads
  kv_lora_rank + rope values per key, whatever the number of heads.

Shapes: n = query rows, H = heads, T = keys attended, C = kv_lora_rank, R = qk_rope_head_dim,
P = qk_nope_head_dim, V = v_head_dim, L = C + R (the latent row).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from layersplit.shards.kernels import (
    first_line,
    fused_kernels_available,
    switched_off,
)
from layersplit.shards.layers.attention import scores_f32
from layersplit.shards.layers.fused_linear import concat_linears
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.rotary import apply_rope
from layersplit.shards.layers.step import SegmentsRefused, StepInfo
from layersplit.shards.model_config import ModelConfig
from torch import nn

log = logging.getLogger(__name__)

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotary over dims stored as interleaved pairs (x0, x1), (x2, x3), ...: each pair rotated by
    one frequency, the result laid out as [evens, odds] (transformers'
    `apply_rotary_pos_emb_interleave`). x: (n, heads, R); cos/sin: (n, R) as `rope_cos_sin`."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    """Parameter names as transformers' `DeepseekV3Attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        h, n, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        self.num_heads = n
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank, self.latent = m.kv_lora_rank, m.latent_width
        self.scale = m.softmax_scale
        self.interleave = m.rope_interleave
        qk = self.nope + self.rope
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, n * qk, bias=False)
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = nn.Linear(h, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.latent, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, h, bias=bias)
        self.in_proj: nn.Module | None = None  # `fuse`: the two projections of x as one
        self.first_width = m.q_lora_rank or n * qk  # (q's, or its bottleneck's, in in_proj)

    def fuse(self) -> None:
        """One matmul of the step's input for the query (or its bottleneck) and the latent row
        (a GPU's layout: one launch where there were two); once."""
        if self.in_proj is not None:
            return
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        self.in_proj = concat_linears(first, self.kv_a_proj_with_mqa)
        del self.kv_a_proj_with_mqa
        if self.q_proj is not None:
            self.q_proj = None
        else:
            self.q_a_proj = None

    TAKES_NORM = True  # (`forward`'s norm: the decoder layer's input norm, `llama.DecoderLayer`)

    def _project(self, x: torch.Tensor, norm: nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's queries (n, H * (P + R)) and kv_a_proj's latent rows (n, C + R); `norm`:
        x's norm, yet to apply (in the fused input projection's launch where it takes it)."""
        if self.in_proj is not None:
            normed = getattr(self.in_proj, "normed", None)
            y = (self.in_proj(x) if norm is None else normed(x, norm) if normed is not None
                 else self.in_proj(norm(x)))
            first, a = y.split([self.first_width, self.latent], dim=-1)
        else:
            if norm is not None:
                x = norm(x)
            first = (self.q_proj if self.q_proj is not None else self.q_a_proj)(x)
            a = self.kv_a_proj_with_mqa(x)
        if self.q_b_proj is None:
            return first, a
        return self.q_b_proj(self.q_a_layernorm(first)), a

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (apply_rope_interleaved if self.interleave else apply_rope)(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,  # (n, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv,  # KVCache or PagedKVCache
        layer: int,
        slot: int,
        step: StepInfo,
        norm: nn.Module | None = None,  # x's norm, yet to apply (`TAKES_NORM`)
    ) -> torch.Tensor:
        if step.parts:
            raise SegmentsRefused("latent attention runs one sequence's eager step at a time")
        if step.grouped and mla_kernel_applies(kv, x.device):  # (a captured step's)
            out = self._kernel_step(x, cos, sin, kv, layer, slot, step, norm)
            if out is not None:
                return self.o_proj(out)
        n, nh = x.shape[0], self.num_heads
        q, a = self._project(x, norm)
        q_nope, q_pe = q.view(n, nh, -1).split([self.nope, self.rope], dim=-1)
        c, k_pe = a.split([self.rank, self.rope], dim=-1)
        q_pe = self._rope(q_pe, cos, sin)
        row = torch.cat([self.kv_a_layernorm(c), self._rope(k_pe[:, None], cos, sin)[:, 0]],
                        dim=-1)  # (n, L): this step's latent rows
        half = kv.layout.head_dim
        if 2 * half != self.latent:  # (an odd width: one column of padding)
            row = F.pad(row, (0, 1))
        k_half, v_half = row[:, None, :half], row[:, None, half:]
        if step.lo is not None:  # a batched step: each sequence's row halves (S, T, L/2)
            keys, values = kv.append_batch(layer, step, k_half, v_half)
            return self.o_proj(self._absorbed(q_nope, q_pe, keys[:, :, 0], values[:, :, 0],
                                              step.mask))
        keys, values = kv.append(layer, slot, step, k_half, v_half)  # (T, 1, L/2) each
        if n > 1 and not step.grouped:
            lat = torch.cat([keys, values], dim=-1)[:, 0, :self.latent]  # (T, L)
            return self.o_proj(self._decompressed(q_nope, q_pe, lat, step))
        return self.o_proj(self._absorbed(q_nope, q_pe, keys[None, :, 0], values[None, :, 0],
                                          step.mask))

    def _decompressed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                      step: StepInfo) -> torch.Tensor:
        """Per-head K/V expanded from the T latents, then SDPA (a prefill chunk). (n, H * V)"""
        n, nh, t = q_nope.shape[0], self.num_heads, lat.shape[0]
        c, pe = lat.split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(t, nh, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, pe[:, None].expand(t, nh, self.rope)], dim=-1)  # (T, H, P + R)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (n, H, P + R)
        from_start = step.causal and n == t
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=None if from_start else step.mask, is_causal=from_start,
            scale=self.scale)  # (1, H, n, V)
        return out[0].transpose(0, 1).reshape(n, -1)

    def _query_row(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The queries in the latent row's layout, [q_nope W_UK, q_pe]: (n, H, L)."""
        w_uk = self._kv_b()[0]
        q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (n, H, C)
        return torch.cat([q_lat, q_pe], dim=-1)

    def _heads_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """W_UV applied to the latent outputs (n, H, C): (n, H * V)."""
        n = o_lat.shape[0]
        out = torch.matmul(o_lat.transpose(0, 1), self._kv_b()[1])  # (H, n, V)
        return out.transpose(0, 1).reshape(n, -1)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in the latent space for S sequences' rows: `keys` and `values` (S, T, L/2)
        are the two halves of their latent rows, read where the cache holds them (no copy of
        the rows); query row s * r + j belongs to sequence s, r = n / S; `mask`: (n, T) or
        None. The query is laid out as a latent row ([q W_UK, q_pe]) and split the same way,
        so its scores are the sum of one product with each half. (n, H * V)"""
        n, nh = q_nope.shape[:2]
        s, t, half = keys.shape
        r = n // s
        q_row = self._query_row(q_nope, q_pe)  # (n, H, L)
        if 2 * half != self.latent:
            q_row = F.pad(q_row, (0, 1))
        q_k, q_v = q_row.reshape(s, r * nh, 2 * half).split(half, dim=-1)
        # (in float32, as the decode kernel's and SDPA's: `scores_f32`)
        scores = (scores_f32(q_k, keys.transpose(1, 2)) +
                  scores_f32(q_v, values.transpose(1, 2))) * self.scale  # (S, r*H, T)
        if mask is not None:
            seen = mask.reshape(s, r, 1, t).expand(s, r, nh, t).reshape(s, r * nh, t)
            scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(keys.dtype)
        # the probabilities' sum of the latents c (the first C values of the rows)
        o_lat = torch.matmul(probs, keys[..., :self.rank])
        if self.rank > half:
            o_lat = torch.cat([o_lat, torch.matmul(probs, values[..., :self.rank - half])], -1)
        return self._heads_out(o_lat.view(n, nh, self.rank))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK (H, P, C) and W_UV^T (H, C, V): views, no copies."""
        nh = self.num_heads
        w = self.kv_b_proj.weight.view(nh, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:].transpose(1, 2)

    def _kernel_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv,
                     layer: int, slot: int, step: StepInfo,
                     norm: nn.Module | None = None) -> torch.Tensor | None:
        """The absorbed attention through Triton kernels, up to o_proj's input (n, H * V): the
        latent rows written and the queries' rotary (`mla_step.mla_rows`), W_UK folded into
        the queries and W_UV applied to the latent outputs (`mla_step.heads_matmul`), the
        attention reading the pool in place (`mla_decode`): 4-5 launches where the torch path
        takes ~30 (W_UV in the combine's where the keys are split in at most 32;
        `LAYERSPLIT_MLA_COMBINE_UV=0`: apart). None where a kernel failed to build (the torch
        path then runs, from now on)."""
        from layersplit.shards.kernels.mla_decode import mla_decode
        from layersplit.shards.kernels.mla_step import heads_matmul, mla_rows, rows_and_queries

        n, nh = x.shape[0], self.num_heads
        try:
            q, a = self._project(x, norm)
            q = q.view(n, nh, self.nope + self.rope)
            k_pool, v_pool, write, read = kv.pool_index(layer, slot, step)
            q_row = torch.empty(n, nh, self.latent, dtype=q.dtype, device=q.device)
            kv_norm = self.kv_a_layernorm
            w_uk, w_uv = self._kv_b()
            if not (n == 1 and _rows_fused() and _optional_launch(
                    "rows off", "the MLA step's one-launch latent and query rows",
                    "they take two launches",
                    rows_and_queries, a, kv_norm.weight, kv_norm.eps, cos, sin, write,
                    k_pool[:, 0], v_pool[:, 0], q[..., self.nope:], q[..., :self.nope], w_uk,
                    q_row, self.interleave)[0]):
                mla_rows(a, kv_norm.weight, kv_norm.eps, cos, sin, write, k_pool[:, 0],
                         v_pool[:, 0], q[..., self.nope:], q_row, self.interleave)
                heads_matmul(q[..., :self.nope], w_uk, q_row[..., :self.rank])
            s = read.shape[0]
            last = step.positions if step.rows is None else step.rows
            args = (q_row.view(s, -1, self.latent), k_pool[:, 0], v_pool[:, 0], read,
                    step.mask, nh, self.rank, self.scale, last)
            ok, out = _optional_launch(
                "combine uv off", "the MLA combine with W_UV",
                "the combine and W_UV take two launches", mla_decode, *args, w_uv=w_uv
            ) if _uv_combine() else (False, None)
            if not ok:
                o = mla_decode(*args)
                out = torch.empty(n, nh, self.v_dim, dtype=q.dtype, device=q.device)
                heads_matmul(o.view(n, nh, self.rank), w_uv, out, block_n=16)
        except (torch.cuda.OutOfMemoryError, IndexError):  # (the step's own: a full cache)
            raise
        except Exception as e:  # noqa: BLE001 - a Triton build failure: the torch path runs
            _KERNEL["off"] = True
            log.warning("the MLA decode kernels failed (%s); latent attention runs in torch "
                        "from now on", first_line(e))
            return None
        return out.view(n, -1)


MLA_KERNEL_SWITCH = "LAYERSPLIT_MLA_KERNEL"  # 0: the torch absorbed form on GPUs too
# 0: the latent rows (`mla_step.mla_rows`) and W_UK's products (`heads_matmul`) in two launches,
# not one (`mla_step.rows_and_queries`). One launch only for a step of one row: DeepSeek-V2-Lite
# width, H200, D4: batch 1 389.3 against 386.7 tok/s, but 8 streams 1,172.9 against 1,191.3
MLA_ROWS_SWITCH = "LAYERSPLIT_MLA_FUSED_ROWS"
# W_UV applied to the latent outputs in the key splits' combine (`mla_decode`'s `w_uv`), one
# launch fewer (0: the combine, then `heads_matmul`): DeepSeek-V2-Lite width, H200, D4, batch 1
# 465.3 against 448.3 tok/s, 1.038 x (2026-12-01)
COMBINE_UV_SWITCH = "LAYERSPLIT_MLA_COMBINE_UV"
_KERNEL: dict[str, bool] = {}  # "off" -> the kernel failed once in this process ("rows off":
# the one-launch rows; "combine uv off": W_UV in the combine)


def _rows_fused() -> bool:
    return not _KERNEL.get("rows off") and \
        not switched_off(MLA_ROWS_SWITCH)


def _uv_combine() -> bool:
    return not _KERNEL.get("combine uv off") and not switched_off(COMBINE_UV_SWITCH)


def _optional_launch(flag: str, what: str, instead: str, fn, *args,
                     **kwargs) -> tuple[bool, Any]:
    """(True, fn(*args, **kwargs)), or (False, None) where it failed to build or launch: `flag`
    is then set in `_KERNEL` for the process and said once (`what` failed; `instead`: what
    runs in its place); the step's own errors (out of memory, index, an operand the kernel refuses:
    ValueError, which `_kernel_step` reports) propagate. For launches that fuse what other
    kernels also do: `rows_and_queries` ("rows off") and W_UV in the combine ("combine uv
    off")."""
    try:
        return True, fn(*args, **kwargs)
    except (torch.cuda.OutOfMemoryError, IndexError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - a Triton build failure: the launches it fused run
        _KERNEL[flag] = True
        log.warning("%s failed (%s); %s from now on", what, first_line(e), instead)
        return False, None


def mla_kernel_applies(kv, device: torch.device) -> bool:
    """Whether a captured step's latent attention takes the Triton kernel: a paged pool (a
    shard's) on a device where the decode kernels run, unless switched off."""
    if _KERNEL.get("off") or not hasattr(kv, "pool_index"):
        return False
    if switched_off(MLA_KERNEL_SWITCH):
        return False
    return fused_kernels_available(device)
