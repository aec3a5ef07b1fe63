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
from layersplit.shards.fused_hybrid import MAX_BATCH_ROWS
from layersplit.shards.hybrid_cache import HybridCache, PagedHybridCache
from layersplit.shards.hybrid_config import HybridSpec
from layersplit.shards.kv_cache import KVLayout
from layersplit.shards.layers.attention import attend, attend_batch
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
        if step.lo is not None:  # a batched decode step: row b is sequence b's (`slot` unused)
            keys, values = kv.append_batch(layer, step, k, v)  # (n, T, G, D) each
            out = attend_batch(q, keys, values, step.mask, d ** -0.5)
        else:
            keys, values = kv.append(layer, slot, step, k, v)  # (T, G, D) each
            out = attend(q, keys, values, step.mask, step.causal)
        return self.o_proj(gate_output(out, gate))


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
        if self.fast is not None and keep is None and (
                h.shape[0] == 1 or (step.lo is not None and h.shape[0] <= MAX_BATCH_ROWS)):
            return self.fast(self, h, cos, sin, kv, index, slot, step)
        x = self.input_layernorm(h)
        if self.linear and step.lo is not None:  # a batched step: one row a sequence
            # (each row's states gathered from its slot, advanced, written back: graph-safe)
            conv, state = kv.gather_states(index, step.states)
            out, _ = self.linear_attn(x[:, None], conv, state)
            kv.scatter_states(index, step.states, conv, state)
            h = h + out[:, 0]
        elif self.linear:
            s = slice(slot, slot + 1)
            conv, state = kv.conv[index, s], kv.state[index, s]
            if keep is not None and step.states is not None:  # (a verify graph of any slot:
                # its slot's states, read only, are gathered)
                conv, state = kv.gather_states(index, step.states)
            into = None if keep is None else (keep[0][index][None], keep[1][index][None])
            out, _ = self.linear_attn(x[None], conv, state,
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
        A batched decode step (`StepInfo.batched` with `states`: row b is one token of the
        sequence whose states are in slot `states[b]`) advances each row's slot's states.

        `keep` makes the step a chain's verify step (`new_keep`'s buffers): the linear layers
        run the recurrent rule over the rows and write the conv and recurrent state after each
        row there, leaving the slot's states as they were; the caller settles on the last
        accepted row's (`HybridState.keep_rows`)."""
        h = self.embed_tokens(x) if self.is_first else x
        if isinstance(step, int):
            step = StepInfo.eager(step, h.shape[0], h.device)
        if step.lo is not None and (step.states is None or keep is not None):
            raise NotImplementedError("a hybrid range's batched steps are decode steps that "
                                      "name each row's state slot (`StepInfo.states`)")
        if step.pos is None and h.shape[0] != 1 and keep is None and step.lo is None:
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

    def graph_safe(self, rows: int) -> bool:
        """Whether a step of `rows` rows through the range may be captured: no layer's mixture
        of experts would sync the host there (`RoutedMoE.graph_safe`)."""
        dtype = self.layers[0].input_layernorm.weight.dtype
        return all(layer.mlp.graph_safe(rows, dtype) for layer in self.layers
                   if isinstance(layer.mlp, RoutedMoE))

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
