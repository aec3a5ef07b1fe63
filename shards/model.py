"""Decoder-only transformer for the Llama family, Qwen2 and Qwen3, built for a layer range.

Pure torch: this module knows nothing of processes. A `LayerRange` holds layers [start, end) of
the model; only the first range owns the token embedding, only the last the final norm and the
LM head (tied embeddings are loaded on both). Every range reads and writes its own `KVCache`.

Shapes: n = tokens in this step, H = query heads, G = KV heads, D = head dim, T = keys attended.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shards.kv_cache import KVCache
from shards.model_config import ModelConfig
from shards.spec_tree import ancestors, depths


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the scaling real checkpoints use: default, linear, llama3."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = cfg.rope_params
    if cfg.rope_type == "linear":
        inv = inv / float(p["factor"])
    elif cfg.rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (n, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (n, heads, D); cos/sin: (n, D)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


@dataclasses.dataclass(slots=True)
class StepInfo:
    """Where a step's n tokens go and which keys they attend.

    Eager steps (`eager`) write KV rows by slice and attend exactly pos + n keys. Static steps
    (`static`, for CUDA-graph capture) take the position from a device tensor, write rows with
    `index_copy_` and attend a fixed `kv_len` keys under a mask, so one captured graph serves
    every position up to `kv_len`. Batched steps (`batched`, continuous batching) are static
    decode steps of several sequences at once: row b is one token of the sequence in slot lo + b.
    """

    positions: torch.Tensor  # (n,) long, on the model's device
    kv_len: int  # key rows attended
    mask: torch.Tensor | None  # (n, kv_len) bool, True = attend; None = all (eager decode)
    pos: int | None  # first position, when known on the host (eager)
    grouped: bool = False  # attend with query heads grouped per KV head (static decode)
    lo: int | None = None  # batched step: the slot of row 0
    slots: torch.Tensor | None = None  # batched step: (n,) long, the slot of each row
    rows: torch.Tensor | None = None  # static step: (n,) KV rows written, when not `positions`
    windowed: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that sees only keys within `window` positions of each query
        (transformers' sliding window: key k is seen by query q iff q - window < k <= q), or
        the step's own mask for full attention. Computed once per step and window.

        A key's position is its KV row, except the rows a tree verify step writes: row
        pos + j holds the token at position pos + depth(j), so those rows take the step's
        positions (a deep tree in a short window still sees the right ancestors)."""
        if window is None or (self.pos is not None and self.kv_len <= window):
            return self.mask  # no query can be `window` positions past key 0
        m = self.windowed.get(window)
        if m is None:
            dev = self.positions.device
            key_pos = torch.arange(self.kv_len, device=dev)
            if self.lo is None:  # a single sequence: its written rows may be a tree's
                n = self.positions.shape[0]
                rows = (self.rows if self.rows is not None else
                        torch.arange(self.pos, self.pos + n, device=dev)
                        if self.pos is not None else self.positions)
                key_pos = key_pos.index_copy(0, rows, self.positions)
            near = key_pos[None, :] > self.positions[:, None] - window
            m = near if self.mask is None else self.mask & near
            self.windowed[window] = m
        return m

    @staticmethod
    def eager(pos: int, n: int, device: torch.device) -> StepInfo:
        positions = torch.arange(pos, pos + n, device=device)
        mask = None
        if n > 1:
            mask = torch.arange(pos + n, device=device)[None, :] <= positions[:, None]
        return StepInfo(positions, pos + n, mask, pos)

    @staticmethod
    def static(pos: torch.Tensor, n: int, kv_len: int) -> StepInfo:
        """`pos`: a (1,) long device tensor holding the first position (graph input)."""
        positions = pos + torch.arange(n, device=pos.device)
        mask = torch.arange(kv_len, device=pos.device)[None, :] <= positions[:, None]
        return StepInfo(positions, kv_len, mask, None, grouped=True)

    @staticmethod
    def tree(pos: int, parents: Sequence[int], device: torch.device) -> StepInfo:
        """An eager verify step over a token tree (`shards.spec_tree`): row j at position
        pos + depth(j), its K/V written at row pos + j, attending [0, pos) and its ancestors."""
        anc = ancestors(parents)
        n = anc.shape[0]
        mask = torch.cat([torch.ones(n, pos, dtype=torch.bool), anc], dim=1).to(device)
        positions = pos + torch.tensor(depths(parents), device=device)
        return StepInfo(positions, pos + n, mask, pos)

    @staticmethod
    def static_tree(pos: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                    kv_len: int) -> StepInfo:
        """`tree` for a captured graph: `pos` (1,), `depth` (n,) and `anc` (n, n) bool are
        device tensors (graph inputs), so one graph serves every tree of n rows. A chain's
        depth and ancestors make it `static`'s verify step."""
        n = depth.shape[0]
        dev = pos.device
        keys = torch.arange(kv_len, device=dev)
        rel = keys - pos
        in_tree = (rel >= 0) & (rel < n)
        mask = (keys < pos)[None, :] | (anc[:, rel.clamp(0, n - 1)] & in_tree[None, :])
        rows = pos + torch.arange(n, device=dev)
        return StepInfo(pos + depth, kv_len, mask, None, grouped=True, rows=rows)

    @staticmethod
    def batched(positions: torch.Tensor, lo: int, kv_len: int) -> StepInfo:
        """One decode row per slot of [lo, lo + B): row b at position `positions[b]` of slot
        lo + b, attending that slot's keys [0, kv_len). `positions`: (B,) long on the device (a
        graph input); a padding row's position is the cache's scratch row (`KVCache.max_len`),
        which no real row attends."""
        dev = positions.device
        mask = torch.arange(kv_len, device=dev)[None, :] <= positions[:, None]
        slots = lo + torch.arange(positions.shape[0], device=dev)
        return StepInfo(positions, kv_len, mask, None, grouped=True, lo=lo, slots=slots)


def group_queries(q: torch.Tensor, g: int) -> torch.Tensor:
    """Queries (n, H, D) as (G, H/G * n, D): the query rows of each of the G KV heads, for
    `Attention._grouped`. (Inside the compiled decode step, `shards.fused`, this layout is
    written by the rotary's own kernel; eager, a verify step's several rows cost a copy.)"""
    n, h, d = q.shape
    return q.view(n, g, h // g, d).permute(1, 2, 0, 3).reshape(g, h // g * n, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.window = cfg.window(layer)  # None: full causal attention
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, g * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, g * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Linear | None = None  # set by `fuse_projections` (GPU)

    def fuse(self) -> None:
        """One matmul for q, k and v (fewer, larger kernels on a GPU)."""
        ps = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(1, 1, bias=ps[0].bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight for p in ps]), requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in ps]), requires_grad=False)
        self.qkv_proj = fused
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
        n = x.shape[0]
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
        # plain causal from position 0: flash attention applies (a window needs its mask)
        from_start = step.pos == 0 and n > 1 and mask is step.mask
        gqa = self.num_heads != self.num_kv_heads
        if gqa and mask is not None and not from_start and keys.is_cuda:
            # a chunk after the first, on a GPU: the fused kernels that take a mask do not
            # take GQA (the fallback would materialize n x T scores per head), so repeat K/V
            r = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(r, dim=1), values.repeat_interleave(r, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # (1, H, n, D)
            keys.transpose(0, 1)[None],  # (1, G, T, D)
            values.transpose(0, 1)[None],
            attn_mask=None if from_start else mask,
            is_causal=from_start,
            enable_gqa=gqa,
        )  # (1, H, n, D)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))

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
        scores = torch.matmul(qg, keys.permute(1, 2, 0)) * (d ** -0.5)  # (G, r*n, T)
        if mask is not None:
            scores = scores.masked_fill(~mask.repeat(r, 1), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(0, 1))  # (G, r*n, D)
        return out.view(g, r, n, d).permute(2, 0, 1, 3).reshape(n, -1)

    def _grouped_batch(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """`_grouped` for a batched step: query row b (its H heads as G groups of H/G) attends
        keys[b] (T, G, D), the keys of its own slot, under mask row b."""
        b, g, d = q.shape[0], self.num_kv_heads, self.head_dim
        qg = q.reshape(b, g, self.num_heads // g, d)  # (B, G, r, D)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * (d ** -0.5)  # (B, G, r, T)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # (B, G, r, D)
        return out.reshape(b, -1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by `fuse_projections` (GPU)

    def fuse(self) -> None:
        fused = nn.Linear(1, 1, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]),
                                    requires_grad=False)
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fast = None  # a compiled decode step (shards.fused), set on GPUs

    def forward(self, h, cos, sin, kv, layer, slot, step: StepInfo) -> torch.Tensor:
        if self.fast is not None and step.grouped:
            return self.fast(self, h, cos, sin, kv, layer, slot, step)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, slot, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerRange(nn.Module):
    """Layers [start, end) of a model; first range embeds tokens, last range returns logits."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside 0..{cfg.num_layers}")
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(start, end))
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.norm = self.lm_head = None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def forward(
        self,
        x: torch.Tensor,  # (n,) token ids on the first range, else (n, hidden)
        step: StepInfo | int,
        kv: KVCache,
        slot: int = 0,
        logit_rows: slice | None = None,
        taps: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run this range for n tokens at positions [pos, pos + n) (`step`: pos or a StepInfo),
        or for one token of each of n sequences (`StepInfo.batched`; `slot` is then unused).

        Returns hidden states (n, hidden), or on the last range the logits of `logit_rows`
        (all rows when None). `taps`, when given, has a key per global layer index whose output
        rows (n, hidden) are stored under it (they feed a feature-conditioned draft).
        """
        h = self.embed_tokens(x) if self.is_first else x
        if isinstance(step, int):
            step = StepInfo.eager(step, h.shape[0], h.device)
        cos, sin = rope_cos_sin(self.inv_freq, step.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv, i, slot, step)
            if taps is not None and self.start + i in taps:
                # as HF's hidden_states[layer + 1]: the last layer's output is after the norm
                last = self.start + i == self.cfg.num_layers - 1
                taps[self.start + i] = self.norm(h) if last else h
        if not self.is_last:
            return h
        if logit_rows is not None:
            h = h[logit_rows]
        return self.lm_head(self.norm(h)).float()

    def local_name(self, name: str) -> str:
        """Map a canonical HF tensor name to this module's parameter name."""
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight"
        if name == "model.norm.weight":
            return "norm.weight"
        if name == "lm_head.weight":
            return "lm_head.weight"
        prefix, idx, rest = name.split(".", 3)[1], name.split(".")[2], name.split(".", 3)[3]
        assert prefix == "layers", name
        return f"layers.{int(idx) - self.start}.{rest}"
