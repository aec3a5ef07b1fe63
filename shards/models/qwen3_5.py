"""Hybrid Qwen models for a layer range: Qwen3.5 (text) and Qwen3-Next.

Layers alternate, as `layer_types` says, between
- linear attention: a Gated DeltaNet block (`shards.layers.gated_delta`) whose per-sequence
  state is a conv state and a recurrent state (`shards.hybrid_cache.HybridCache`);
- full attention: GQA over the KV cache with q/k RMSNorms, a rotary embedding over the first
  `partial_rotary_factor` of each head and a sigmoid output gate carried in `q_proj`.
All RMSNorms but the delta block's output norm are zero-centred (weight 1 + w). The MLP is a
SwiGLU, or on the sparse layers of Qwen3-Next and Qwen3.5-MoE a mixture of experts with a
sigmoid-gated shared expert (`shards.layers.routed_moe.RoutedMoE`, as the MoE families').

Prefill chunks run the chunked delta rule, one-token steps the recurrent one. For a tensor
name of the checkpoint the module's parameter is `local_name(name)`, as for `LayerRange`.

Shapes: n = tokens in this step, H / G = query / KV heads, D = head dim.
"""

from __future__ import annotations

import torch
from layersplit.shards.hybrid_cache import HybridCache, PagedHybridCache
from layersplit.shards.hybrid_config import HybridSpec
from layersplit.shards.kv_cache import KVLayout
from layersplit.shards.layers.attention import attend
from layersplit.shards.layers.fused_linear import concat_linears
from layersplit.shards.layers.gated_attention import (
    ZeroCentredRMSNorm,
    apply_partial_rope,
    gate_output,
    rotary_dim,
    split_query_gate,
)
from layersplit.shards.layers.gated_delta import GatedDeltaNet
from layersplit.shards.layers.mlp import MLP
from layersplit.shards.layers.rotary import base_inv_freq, rope_cos_sin
from layersplit.shards.layers.routed_moe import RoutedMoE
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.model_config import ModelConfig
from torch import nn


def hybrid_inv_freq(cfg: ModelConfig, spec: HybridSpec) -> torch.Tensor:
    dim = rotary_dim(cfg.head_dim, spec.partial_rotary_factor)
    return base_inv_freq(cfg.rope_theta, dim)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * h * d, bias=bias)  # query and gate
        self.k_proj = nn.Linear(cfg.hidden_size, g * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, g * d, bias=bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # q (with its gate), k, v in one; `fuse` (GPU)

    def fuse(self) -> None:
        """One q/k/v projection (rows: query and gate, k, v); the three are freed (once)."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, hidden) -> q_proj's output (n, 2 H D), k and v (n, G * D)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        return self.qkv_proj(x).split([2 * h * d, g * d, g * d], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: HybridCache,
                layer: int, slot: int, step: StepInfo) -> torch.Tensor:
        n, h, g, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.project(x)
        q, gate = split_query_gate(qg, h, d)
        k = self.k_norm(k.reshape(n, g, d))
        v = v.reshape(n, g, d)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(k, cos, sin)
        keys, values = kv.append(layer, slot, step, k, v)  # (T, G, D) each
        return self.o_proj(gate_output(attend(q, keys, values, step.mask, step.causal), gate))


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: HybridSpec, layer: int) -> None:
        super().__init__()
        self.linear = spec.is_linear(layer)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, spec.num_key_heads, spec.num_value_heads, spec.key_head_dim,
                spec.value_head_dim, spec.conv_kernel, cfg.rms_norm_eps, spec.fused_projections)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp: nn.Module = RoutedMoE(cfg) if cfg.is_moe(layer) else MLP(cfg)
        self.fast = None  # the fused one-token step (`shards.fused_hybrid`), set on GPUs

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: HybridCache,
                index: int, slot: int, step: StepInfo,
                keep: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`index`: this layer's rank among the range's layers of its kind. `keep`: a verify
        step's (conv, state) after each row, (linear layers, n, ...) each, which a linear
        layer fills at its `index` and leaves the slot's states as they were
        (`HybridRange.forward`)."""
        if self.fast is not None and h.shape[0] == 1 and keep is None:
            return self.fast(self, h, cos, sin, kv, index, slot, step)
        x = self.input_layernorm(h)
        if self.linear:
            s = slice(slot, slot + 1)
            into = None if keep is None else (keep[0][index][None], keep[1][index][None])
            out, _ = self.linear_attn(x[None], kv.conv[index, s], kv.state[index, s],
                                      recurrent=True if keep is not None else None,
                                      keep_states=keep is not None, into=into)
            h = h + out[0]
        else:
            h = h + self.self_attn(x, cos, sin, kv, index, slot, step)
        return h + self.mlp(self.post_attention_layernorm(h))


def DecoderLayer(cfg: ModelConfig, layer: int) -> HybridLayer:  # noqa: N802 - the registry's
    """Global layer `layer` (the registry's entry point); ranges are `HybridRange`s."""
    return HybridLayer(cfg, cfg.hybrid, layer)


class HybridRange(nn.Module):
    """Layers [start, end) of a hybrid model; as `shards.model.LayerRange`, the first range
    embeds tokens and the last returns logits. Its cache is a `HybridCache` (`new_cache`)."""

    def __init__(self, cfg: ModelConfig, start: int, end: int,
                 spec: HybridSpec | None = None) -> None:
        super().__init__()
        spec = spec if spec is not None else cfg.hybrid
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside 0..{cfg.num_layers}")
        self.cfg, self.spec, self.start, self.end = cfg, spec, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size,  # (not initialized: `LayerRange`)
                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            if self.is_first else None
        )
        self.layers = nn.ModuleList(HybridLayer(cfg, spec, i) for i in range(start, end))
        # each layer's rank among the range's layers of its kind (its cache index)
        self.linear_layers = [i for i in range(start, end) if spec.is_linear(i)]
        self.attn_layers = [i for i in range(start, end) if not spec.is_linear(i)]
        self.cache_index = [
            (self.linear_layers if spec.is_linear(i) else self.attn_layers).index(i)
            for i in range(start, end)
        ]
        if self.is_last:
            self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.norm = self.lm_head = None
        self.register_buffer("inv_freq", hybrid_inv_freq(cfg, spec), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def rope_inv_freq(self) -> torch.Tensor:
        return hybrid_inv_freq(self.cfg, self.spec)

    def new_cache(self, max_len: int, slots: int, device: torch.device | str,
                  dtype: torch.dtype, paged: tuple[int, int] | None = None
                  ) -> HybridCache | PagedHybridCache:
        """The range's KV and state; `paged`: (blocks, block tokens) of a paged KV pool."""
        cfg, spec = self.cfg, self.spec
        layout = KVLayout(len(self.attn_layers), cfg.num_kv_heads, cfg.head_dim, dtype)
        states = (len(self.linear_layers), (spec.conv_dim, spec.conv_kernel - 1),
                  (spec.num_value_heads, spec.key_head_dim, spec.value_head_dim))
        if paged is not None:
            return PagedHybridCache(layout, max_len, slots, *paged, device, *states)
        return HybridCache(layout, max_len, slots, device, *states)

    def forward(
        self,
        x: torch.Tensor,
        step: StepInfo | int,
        kv: HybridCache,
        slot: int = 0,
        logit_rows: slice | None = None,
        taps: dict[int, torch.Tensor] | None = None,
        keep: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As `LayerRange.forward`, for one sequence's rows: an eager step, or a captured
        one-token decode step (`StepInfo.static`, position on the device) of a sequence past
        position 0, which advances the slot's recurrent states in place as an eager step does.
        Batched steps are not for hybrid ranges (each row's state is its own slot's).

        `keep` makes the step a chain's verify step (`new_keep`'s buffers): the linear layers
        run the recurrent rule over the rows and write the conv and recurrent state after each
        row there, leaving the slot's states as they were; the caller settles on the last
        accepted row's (`HybridState.keep_rows`)."""
        h = self.embed_tokens(x) if self.is_first else x
        if isinstance(step, int):
            step = StepInfo.eager(step, h.shape[0], h.device)
        if step.lo is not None:
            raise NotImplementedError("hybrid ranges run no batched steps")
        if step.pos is None and h.shape[0] != 1 and keep is None:
            raise NotImplementedError("a hybrid range's captured steps are one-token decode "
                                      "steps and chain verify steps (which keep each row's "
                                      "states)")
        if step.pos == 0:
            kv.reset(slot)
        cos, sin = rope_cos_sin(self.inv_freq, step.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv, self.cache_index[i], slot, step, keep)
            if taps is not None and self.start + i in taps:
                last = self.start + i == self.cfg.num_layers - 1
                taps[self.start + i] = self.norm(h) if last else h
        if not self.is_last:
            return h
        if logit_rows is not None:
            h = h[logit_rows]
        return self.lm_head(self.norm(h)).float()

    def new_keep(self, kv: HybridCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty buffers for a verify step of n rows to keep each row's states in (`forward`'s
        `keep`): conv (linear layers, n, C, K - 1) in the cache's dtype, state (linear layers,
        n, Hv, Dk, Dv) float32."""
        layers = kv.conv.shape[0]
        return (kv.conv.new_empty((layers, n, *kv.conv.shape[2:])),
                kv.state.new_empty((layers, n, *kv.state.shape[2:])))

    def local_name(self, name: str) -> str:
        """Map a canonical HF tensor name to this module's parameter name."""
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            return name.split(".", 1)[1]
        if name == "lm_head.weight":
            return name
        _, layers, idx, rest = name.split(".", 3)
        assert layers == "layers", name
        return f"layers.{int(idx) - self.start}.{rest}"
