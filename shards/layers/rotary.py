"""Rotary position embeddings: inverse frequencies with the scalings real checkpoints use, and
their application to query/key heads. Shapes: n = tokens, D = head dim."""

from __future__ import annotations

import math

import torch
from layersplit.shards.model_config import ModelConfig


def rope_exponents(dim: int) -> torch.Tensor:
    """2i/dim for i < dim/2, the exponents of the rope frequencies. On the CPU, also while a
    range is built on the meta device (whose first such op costs a process 0.8 s of imports);
    the module's `to(device)` moves what is computed from them."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """The unscaled inverse frequencies theta^(-2i/dim)."""
    return 1.0 / (theta ** rope_exponents(dim))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the scaling real checkpoints use: default, linear, llama3, yarn,
    dynamic (NTK; the same as default at positions below max_position_embeddings, the only
    ones it serves: `model_config.context_limit_error`). Over the `rotary_dim` first dims of
    each head."""
    dim = cfg.rotary_dim
    inv = base_inv_freq(cfg.rope_theta, dim)
    p = cfg.rope_params
    if cfg.rope_type == "yarn":
        inv = _yarn(cfg)[0]
    elif cfg.rope_type == "linear":
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


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor, as transformers'
    `_compute_yarn_parameters` computes them."""
    p = cfg.rope_params
    dim, base = cfg.rotary_dim, cfg.rope_theta
    old_ctx = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / old_ctx
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        attention = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                     if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # (on the CPU: as above)
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    pos_freqs = base ** rope_exponents(dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are scaled by (YaRN's attention factor; 1 otherwise)."""
    return _yarn(cfg)[1] if cfg.rope_type == "yarn" else 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (n, D) of `positions`, times `scale` (`rope_attention_factor`)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (n, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (n, heads, D); cos/sin: (n, R), R <= D: the rotary turns the first R dims of each
    head (a partial rotary, as GLM's) and leaves the others as they are."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
