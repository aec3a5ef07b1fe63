"""The `auto` dtype rule: what a checkpoint stores and where the shards run decide it."""

from __future__ import annotations

import json

import pytest
from layersplit.shards.dtypes import auto_dtype, run_dtype, stored_dtype
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf


def _with_dtype(folder, value):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_cpu_runs_float32_whatever_the_checkpoint():
    for stored in ("bfloat16", "float16", "float32", None):
        assert auto_dtype("llama", stored, ["cpu", "cpu"])[0] == "float32"


@pytest.mark.parametrize("stored,want", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                         ("float32", "float16"), (None, "float16")])
def test_gpu_follows_the_checkpoint(stored, want):
    assert auto_dtype("llama", stored, ["cuda:0", "cuda:1"])[0] == want
    assert auto_dtype("llama", stored, ["cuda:0", "cpu"])[0] == want  # any GPU shard


@pytest.mark.parametrize("stored,want", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                         ("float32", "bfloat16"), (None, "bfloat16")])
def test_float16_is_chosen_only_where_it_was_measured(stored, want):
    dtype, why = auto_dtype("qwen3", stored, ["cuda:0"])
    assert dtype == want
    if stored in ("float32", None):
        assert "not measured on qwen3" in why


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5_text", "qwen3_next"])
def test_families_never_given_float16(family):
    for stored in ("float16", "float32", None):
        dtype, why = auto_dtype(family, stored, ["cuda:0"])
        assert dtype == "bfloat16" and family in why


def test_stored_dtype_of_hf_folders_and_ggufs(tmp_path):
    hf = write_tiny_checkpoint(tmp_path / "hf", "llama")
    assert stored_dtype(_with_dtype(hf, "bfloat16")) == "bfloat16"
    assert stored_dtype(_with_dtype(hf, "float32")) == "float32"
    assert stored_dtype(_with_dtype(hf, "int8")) is None  # not a dtype we run in
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "torch_dtype": None, "dtype": "float16"}))
    assert stored_dtype(hf) == "float16"  # (transformers 5 writes `dtype`)
    assert stored_dtype(write_tiny_gguf(hf, tmp_path / "f32.gguf", "F32")) == "float32"
    q8 = write_tiny_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    assert stored_dtype(q8) is None  # (the family decides: float16 for a Llama)
    assert run_dtype("auto", "llama", q8, ["cuda:0"])[0] == "float16"
    assert run_dtype("auto", "qwen3", q8, ["cuda:0"])[0] == "bfloat16"
    assert stored_dtype("random:qwen3-8b") == "bfloat16"


def test_explicit_dtype_wins(tmp_path):
    hf = _with_dtype(write_tiny_checkpoint(tmp_path / "hf", "llama"), "bfloat16")
    assert run_dtype("float16", "llama", hf, ["cuda:0"]) == ("float16", "as configured")
    assert run_dtype("auto", "llama", hf, ["cuda:0"])[0] == "bfloat16"
