"""Tiny random-weight checkpoints for tests: a real HF folder (config, safetensors, tokenizer) in a
few hundred KB, for each supported family, seeded so every run writes the same bytes. Also a GGUF
writer for them, so the GGUF path is tested without a download.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.weights import range_tensor_shapes
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tk_models

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A few merges so words become multi-byte tokens, as in real BPE vocabularies.
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
           ("Ġ", "s"), ("r", "e"), ("a", "t")]

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    },
    "llama3-rope": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 1, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "llama-linear-rope": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 4, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "llama-yarn-rope": {  # YaRN past an original context shorter than test prompts
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 32},
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
    },
    "mistral-window": {  # every layer windowed; the window is shorter than test prompts
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": 12,
    },
    "qwen2-window": {  # layers >= 3 windowed (Qwen2's max_window_layers)
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": True,
        "sliding_window": 10, "max_window_layers": 3,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False,
    },
    "qwen3_moe": {  # layer 2 dense (mlp_only_layers); top-2 of 8 experts, renormalised
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [2], "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
    "mixtral": {  # top-2 of 4 experts in every layer; a window shorter than test prompts
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 64, "intermediate_size": 48, "num_local_experts": 4,
        "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "hidden_act": "silu", "sliding_window": 24, "router_jitter_noise": 0.0,
    },
    "qwen2_moe": {  # shared expert; odd layers sparse (decoder_sparse_step 2); no renorm
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 6, "num_experts_per_tok": 3,
        "norm_topk_prob": False, "decoder_sparse_step": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "qkv_bias": True,
        "use_sliding_window": False,
    },
    "gemma3_text": {  # layers 2 and 5 global (scaled rope), the others windowed (local rope)
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_activation":
        "gelu_pytorch_tanh", "query_pre_attn_scalar": 24, "sliding_window": 12,
        "sliding_window_pattern": 3, "final_logit_softcapping": 3.0,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "attention_bias": False,
    },
    "deepseek_v3": {  # MLA with a q bottleneck, YaRN (mscale != mscale_all_dim) past 32
        # positions, interleaved rotary; 1 dense layer, then top-3 of 8 experts in the best 2 of
        # 4 groups, renormalised and scaled, and a shared expert
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 32},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "aux_loss_alpha": 0.001,
    },
    "deepseek_v3-noq": {  # q_lora_rank null (one q_proj, as DeepSeek-V2-Lite); an odd latent
        # width (27 + 8); plain rotary, not interleaved; ungrouped routing without renorm; two
        # shared experts (one MLP twice as wide); 2 dense layers
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 27,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 6,
        "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.5, "norm_topk_prob": False, "first_k_dense_replace": 2,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "rope_interleave": False,
        "tie_word_embeddings": False, "hidden_act": "silu",
    },
}
# Each MoE family's per-expert tensor names in published checkpoints: (MLP prefix,
# {canonical part: name under `experts.N.`}); see `shards.expert_weights`.
_HF_EXPERTS = {
    "mixtral": ("block_sparse_moe.", {"gate": "w1.weight", "up": "w3.weight",
                                      "down": "w2.weight"}),
}
_QWEN_EXPERTS = ("mlp.", {"gate": "gate_proj.weight", "up": "up_proj.weight",
                          "down": "down_proj.weight"})


def hf_expert_layout(model_type: str, tensors: dict[str, torch.Tensor],
                     layout: str = "per_expert") -> dict[str, torch.Tensor]:
    """Canonical tensors with the experts renamed as a checkpoint stores them: `per_expert`
    (published checkpoints, transformers' save_pretrained) or `fused` (transformers 5's
    in-memory `gate_up_proj`)."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"unknown expert layout {layout!r}")
    out: dict[str, torch.Tensor] = {}
    prefix, names = _HF_EXPERTS.get(model_type, _QWEN_EXPERTS)
    for name, t in tensors.items():
        head, _, tail = name.partition(".mlp.")
        if tail not in ("gate.weight", "experts.gate_proj", "experts.up_proj",
                        "experts.down_proj"):
            out[name] = t
        elif tail == "gate.weight":
            out[f"{head}.{prefix}gate.weight" if layout == "per_expert" else name] = t
        elif layout == "fused":
            if tail == "experts.gate_proj":
                up = tensors[f"{head}.mlp.experts.up_proj"]
                out[f"{head}.mlp.experts.gate_up_proj"] = torch.cat([t, up], dim=1)
            elif tail == "experts.down_proj":
                out[name] = t
        else:
            which = tail.removeprefix("experts.").removesuffix("_proj")
            for e in range(t.shape[0]):
                out[f"{head}.{prefix}experts.{e}.{names[which]}"] = t[e].contiguous()
    return out


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: 3 ChatML specials, the 256 byte symbols and a few merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab.setdefault(a + b, len(vocab))
    tk = Tokenizer(tk_models.BPE(vocab=vocab, merges=_MERGES, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tk


def write_tiny_checkpoint(
    out: str | Path,
    family: str = "llama",
    *,
    num_layers: int = 6,
    seed: int = 0,
    vocab_size: int = 320,
    max_position_embeddings: int = 4096,
    files: int = 1,
    std: float = 0.2,
    expert_layout: str = "per_expert",
) -> Path:
    """Write a seeded random-weight HF folder for `family`; `files` > 1 writes a sharded one.
    A MoE family's experts are stored per expert, or `expert_layout="fused"`
    (`hf_expert_layout`); the weights are the same either way.

    `std` scales the matrices. At 0.2 every layer moves the logits by about a logit standard
    deviation, so greedy output varies and changes when any one layer's weights or KV rows are
    wrong (`tests/shards/test_tiny_models.py`); at 0.08 the tiny Llama repeated one token and
    losing the KV of half its layers left its greedy output unchanged."""
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILY_CONFIGS)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = {
        **FAMILY_CONFIGS[family],
        "num_hidden_layers": num_layers, "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }
    cfg = config_from_hf(raw, out / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in range_tensor_shapes(cfg, 0, cfg.num_layers).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        tensors[name] = t.contiguous()
    if cfg.num_experts:
        tensors = hf_expert_layout(cfg.model_type, tensors, expert_layout)
    names = sorted(tensors)
    if files <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // files)
        weight_map = {}
        for i in range(files):
            fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
            part = {k: tensors[k] for k in names[i * per:(i + 1) * per]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    write_tokenizer(out, max_position_embeddings)
    return out


def write_tokenizer(out: Path, max_position_embeddings: int) -> None:
    tiny_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "model_max_length": max_position_embeddings,
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}, indent=1))


L, F = "linear_attention", "full_attention"
# Tiny hybrid models: linear (L) and full (F) attention interleaved so that 1, 2 and 3 shards
# split inside a run of linear layers and next to an attention layer; GQA, two conv widths,
# two rotary fractions, Qwen3-Next's experts with one dense layer, Qwen3.5-MoE's in every layer.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_5": {
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "layer_types": [L, L, F, L, L, F],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    },
    "qwen3_next": {
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 3, "layer_types": [L, F, L, L, F, L],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "mlp_only_layers": [3],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5},
    },
    "qwen3_5_moe": {  # Qwen3.5-MoE text: every layer's MLP routed, with a shared expert
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "layer_types": [L, L, F, L, L, F], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    },
}


def write_tiny_hybrid(out: str | Path, family: str, *, seed: int = 0, vocab_size: int = 320,
                      std: float = 0.1, **overrides: Any) -> Path:
    """A seeded random Qwen3.5 (text), Qwen3.5-MoE (text) or Qwen3-Next folder made with
    transformers' own classes and `save_pretrained` (transformers is a test dependency), with our
    tokenizer. Weights are drawn larger than transformers' init so greedy output is not
    degenerate."""
    import transformers

    out = Path(out)
    raw = {**HYBRID_CONFIGS[family], "vocab_size": vocab_size, "eos_token_id": 2,
           "pad_token_id": 0, "num_hidden_layers": len(HYBRID_CONFIGS[family]["layer_types"]),
           "max_position_embeddings": 4096, **overrides}
    if family == "qwen3_5":
        cfg, cls = transformers.Qwen3_5TextConfig(**raw), transformers.Qwen3_5ForCausalLM
    elif family == "qwen3_5_moe":
        cfg, cls = transformers.Qwen3_5MoeTextConfig(**raw), transformers.Qwen3_5MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3NextConfig(**raw), transformers.Qwen3NextForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.copy_(0.3 * noise)  # (zero-centred norms, decays and steps of all sizes)
            else:
                p.copy_(std * noise)
    model.save_pretrained(out)
    write_tokenizer(out, raw["max_position_embeddings"])
    return out


def write_tiny_gguf(hf_folder: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """Convert a tiny llama-family HF folder to GGUF the way llama.cpp's converter does
    (q/k rows permuted, tokenizer in the header); matrices stored as `qtype`."""
    import gguf
    from gguf.quants import quantize
    from layersplit.shards.checkpoint_gguf import gguf_name, permute_rows
    from layersplit.shards.checkpoint_hf import HFCheckpoint
    from layersplit.shards.expert_weights import read_tensors

    ckpt = HFCheckpoint(Path(hf_folder))
    cfg = ckpt.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}[cfg.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        if cfg.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.sliding_window:
        if set(cfg.layer_types) != {"sliding_attention"}:
            raise ValueError("GGUF holds one window for every layer, not per-layer windows")
        w.add_sliding_window(cfg.sliding_window)
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_params["factor"]))
    elif cfg.rope_type != "default":
        raise ValueError(f"rope type {cfg.rope_type} has no GGUF form in this writer")
    _add_tiny_tokenizer(w, Path(hf_folder), cfg.vocab_size)
    shapes = range_tensor_shapes(cfg, 0, cfg.num_layers)
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    tensors = read_tensors(ckpt, cfg, shapes, torch.float32)
    q = gguf.GGMLQuantizationType[qtype]
    for name, t in tensors.items():
        a = t.numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute_rows(a, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute_rows(a, cfg.num_kv_heads)
        if a.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        else:
            data = quantize(a, q)
            w.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def _add_tiny_tokenizer(w: Any, hf_folder: Path, vocab_size: int) -> None:
    """The folder's tokenizer into GGUF writer `w`, as llama.cpp's converter writes a BPE one."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), vocab_size)]
    types = [3 if t in SPECIAL_TOKENS else (5 if t.startswith("[PAD") else 1) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


_HYBRID_GGUF_ARCH = {"qwen3_5_text": "QWEN35", "qwen3_5_moe_text": "QWEN35MOE",
                     "qwen3_next": "QWEN3NEXT"}


def write_tiny_hybrid_gguf(hf_folder: str | Path, out: str | Path,
                           edit: Callable[[Any], None] | None = None) -> Path:
    """Convert a tiny hybrid HF folder (`write_tiny_hybrid`) to an F32 GGUF the way llama.cpp's
    converter does (its `Qwen3NextModel` and Qwen3.5 classes), step by step on the folder's own
    tensors, names from the `gguf` package's tensor map: value heads tiled (Qwen3.5), norms
    + 1, `ssm_a` = -exp(A_log), the conv squeezed, Qwen3-Next's `in_proj_qkvz` split into
    `attn_qkv` and `attn_gate`, experts stacked. `edit(writer)` may add fields or tensors
    before the file is written (for tests of what is refused)."""
    import gguf
    from safetensors.torch import load_file

    hf_folder = Path(hf_folder)
    raw = json.loads((hf_folder / "config.json").read_text())
    arch = gguf.MODEL_ARCH[_HYBRID_GGUF_ARCH[raw["model_type"]]]
    n = raw["num_hidden_layers"]
    hk, hv = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
    dk, dv, r = raw["linear_key_head_dim"], raw["linear_value_head_dim"], hv // hk
    types = raw["layer_types"]
    every = next((k for k in range(1, n + 1) if types == [
        "linear_attention" if (i + 1) % k else "full_attention" for i in range(n)]), None)
    if every is None:
        raise ValueError("GGUF holds a full_attention_interval, not these layer_types")
    rope = raw["rope_parameters"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    if "intermediate_size" in raw:
        w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_vocab_size(raw["vocab_size"])
    if raw.get("num_experts"):
        w.add_expert_count(raw["num_experts"])
        w.add_expert_used_count(raw["num_experts_per_tok"])
        w.add_expert_feed_forward_length(raw["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(raw["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(raw["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(every)
    w.add_rope_dimension_count(int(raw["head_dim"] * rope["partial_rotary_factor"]))
    if arch != gguf.MODEL_ARCH.QWEN3NEXT:
        w.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default
    _add_tiny_tokenizer(w, hf_folder, raw["vocab_size"])

    def tiled(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
        if arch == gguf.MODEL_ARCH.QWEN3NEXT or hk == hv:
            return t
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], hk, r, head_dim, *shape[dim + 1:])
        return t.transpose(dim, dim + 1).contiguous().reshape(shape)

    names = gguf.get_tensor_name_map(arch, n)
    tensors = load_file(str(hf_folder / "model.safetensors"))
    experts: dict[str, list[torch.Tensor]] = {}
    out_tensors: dict[str, torch.Tensor] = {}
    for name in sorted(tensors, key=lambda s: (len(s), s)):  # experts 0..E-1 in order
        t = tensors[name]
        if ".linear_attn." in name:  # _LinearAttentionVReorderBase
            q_k = 2 * hk * dk
            if ".in_proj_qkv." in name:
                t = torch.cat([t[:q_k], tiled(t[q_k:], 0, dv)])
            elif ".in_proj_z." in name:
                t = tiled(t, 0, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = tiled(t, 0, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                t = tiled(t[:, None], 0, 1)[:, 0]
            elif ".conv1d." in name:
                t = t.squeeze()
                t = torch.cat([t[:q_k], tiled(t[q_k:], 0, dv)])
            elif ".out_proj." in name:
                t = tiled(t, 1, dv)
        if name.endswith(".A_log"):  # Qwen3NextModel
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            qkvz = t.T.reshape(-1, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
            h = raw["hidden_size"]
            qkv = torch.cat([x.reshape(h, -1) for x in (q, k, v)], dim=-1).T
            layer = name.split(".")[2]
            out_tensors[f"blk.{layer}.attn_qkv.weight"] = qkv
            out_tensors[f"blk.{layer}.attn_gate.weight"] = z.reshape(h, -1).T
            continue
        parts = name.split(".")
        if ".mlp.experts." in name:  # Qwen2MoeModel: stack each projection's experts
            key = ".".join(parts[:5] + parts[6:])  # model.layers.N.mlp.experts.W.weight
            experts.setdefault(key, []).append(t)
            if len(experts[key]) < raw["num_experts"]:
                continue
            name, t = key, torch.stack(experts.pop(key))
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"{name} has no GGUF name for {arch.name}")
        out_tensors[gname] = t
    for gname, t in out_tensors.items():
        w.add_tensor(gname, np.ascontiguousarray(t.float().numpy()))
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
