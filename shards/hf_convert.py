"""An HF transformers model holding the very same weights as a full `LayerRange`.

Used where transformers is the tool for the job and is installed (the HF baseline of the
benchmarks, batched generation when training a draft); the runtime itself never needs it.
"""

from __future__ import annotations

import torch
from layersplit.shards.models import LayerRange


def hf_causal_lm(model: LayerRange, device: str, dtype: torch.dtype, max_context: int):
    """A transformers CausalLM (SDPA attention) sharing `model`'s tensors (no copy)."""
    import transformers

    cfg = model.cfg
    if not (model.is_first and model.is_last):
        raise ValueError("an HF model needs the whole model, not a layer range")
    if cfg.num_experts or cfg.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"an HF copy of a {cfg.model_type} model is not built here (only the "
                         "dense Llama-like families)")
    extra = {}
    if cfg.rope_type != "default":
        extra["rope_scaling"] = {"rope_type": cfg.rope_type, **cfg.rope_params}
    if cfg.layer_types:
        extra.update(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
                     use_sliding_window=True)
    hf_cfg = transformers.AutoConfig.for_model(
        cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=max(cfg.max_position_embeddings, max_context),
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias, **extra,
    )
    with torch.device(device):  # buffers (rotary) are built here; weights replaced below
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                           dtype=dtype)
    state = {}
    for k, v in model.state_dict().items():
        name = {"embed_tokens.weight": "model.embed_tokens.weight",
                "norm.weight": "model.norm.weight"}.get(k, k)
        if k.startswith("layers."):
            name = "model." + k
        state[name] = v
    hf.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(device).eval()
