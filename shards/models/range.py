"""A layer range of any family: layers [start, end) of a model, built for one shard.

Pure torch: this module knows nothing of processes. A `LayerRange` holds layers [start, end) of
the model; only the first range owns the token embedding, only the last the final norm and the
LM head (tied embeddings are loaded on both). Every range reads and writes its own `KVCache`.
Each layer comes from the family's module (`shards.models.registry`).

Shapes: n = tokens in this step, hidden = the model's width.
"""

from __future__ import annotations

import dataclasses

import torch
from layersplit.shards.kv_cache import KVCache
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.rotary import rope_attention_factor, rope_cos_sin, rope_inv_freq
from layersplit.shards.layers.step import StepInfo
from layersplit.shards.model_config import ModelConfig
from layersplit.shards.models.registry import decoder_layer, family_module
from torch import nn


class LayerRange(nn.Module):
    """Layers [start, end) of a model; first range embeds tokens, last range returns logits."""

    def __init__(self, cfg: ModelConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside 0..{cfg.num_layers}")
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        family = family_module(cfg)
        self.embed_tokens = (
            # (no random init: the checkpoint's weights replace it; on the meta device, where
            # ranges are built, normal_ would cost a process 0.8 s of imports)
            nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            if self.is_first else None
        )
        # optional family hooks: embeddings scaled (Gemma: sqrt(hidden)), the final norm's kind
        scale = getattr(family, "embed_scale", None)
        self.embed_scale = None if scale is None else scale(cfg)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(start, end))
        if self.is_last:
            self.norm = getattr(family, "FinalNorm", RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.norm = self.lm_head = None
        # the final norm with the LM head as one step, set on GPUs (`shards.fused`): the
        # logits (float32) of the rows it takes, None for those it does not
        self.head_fast = None
        self.rope_scale = rope_attention_factor(cfg)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)build the rope frequency buffers (they are not in a state dict): the model's, and
        the sliding layers' own where the config gives them a base (`local_rope_theta`)."""
        cfg = self.cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        local = None
        if cfg.local_rope_theta is not None:
            local = rope_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta,
                                                      rope_scaling=()))
        self.register_buffer("local_inv_freq", local, persistent=False)

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
        h = self.embed(x)
        if isinstance(step, int):
            step = StepInfo.eager(step, h.shape[0], h.device)
        cos, sin = rope_cos_sin(self.inv_freq, step.positions, h.dtype, self.rope_scale)
        local = (None if self.local_inv_freq is None else
                 rope_cos_sin(self.local_inv_freq, step.positions, h.dtype))
        for i, layer in enumerate(self.layers):
            if local is not None and self.cfg.window(self.start + i) is not None:
                h = layer(h, *local, kv, i, slot, step)
            else:
                h = layer(h, cos, sin, kv, i, slot, step)
            if taps is not None and self.start + i in taps:
                # as HF's hidden_states[layer + 1]: the last layer's output is after the norm
                last = self.start + i == self.cfg.num_layers - 1
                taps[self.start + i] = self.norm(h) if last else h
        return self.logits(h, logit_rows) if self.is_last else h

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The range's input rows: token ids (n,) embedded on the first range, else `x`."""
        if not self.is_first:
            return x
        h = self.embed_tokens(x)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def logits(self, h: torch.Tensor, logit_rows: slice | torch.Tensor | None) -> torch.Tensor:
        """The last range's float32 logits of rows `logit_rows` (all when None) of its output
        `h`: the final norm and the LM head."""
        if logit_rows is not None:
            h = h[logit_rows]
        cap = self.cfg.final_logit_softcap
        if self.head_fast is not None and cap is None:
            logits = self.head_fast(self, h)
            if logits is not None:
                return logits
        logits = self.lm_head(self.norm(h))
        if cap is not None:  # as transformers: in the run dtype
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

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
