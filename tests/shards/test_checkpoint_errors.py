"""Bad checkpoints give an error that names the file and the tensor or field."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf
from safetensors.torch import load_file, save_file


@pytest.fixture
def folder(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)


def _rewrite(folder, fn):
    st = folder / "model.safetensors"
    tensors = load_file(str(st))
    fn(tensors)
    save_file(tensors, str(st))


def test_missing_tensor(folder):
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_layer_range(open_checkpoint(folder), 0, 2)
    # a range that does not need the tensor still loads
    load_layer_range(open_checkpoint(folder), 0, 1)


def test_wrong_shape(folder):
    def bad(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    _rewrite(folder, bad)
    with pytest.raises(CheckpointError) as e:
        load_layer_range(open_checkpoint(folder), 0, 2)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(3, 64)" in msg
    assert "model.safetensors" in msg


def test_unknown_model_type(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*model_type='mamba'"):
        open_checkpoint(folder)


def test_missing_config_field(folder):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size"):
        open_checkpoint(folder)


def test_truncated_safetensors(folder):
    st = folder / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_layer_range(open_checkpoint(folder), 0, 2)


def test_sharded_index_names_missing_file(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "s", "llama", num_layers=2, files=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_layer_range(open_checkpoint(folder), 0, 2)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"123")
    with pytest.raises(CheckpointError, match="expected a Hugging Face model folder"):
        open_checkpoint(tmp_path / "x.bin")


def _gguf_with(tmp_path, arch="llama", qtype=None, extra=()):
    """A minimal GGUF: header fields of a 1-layer llama, one tensor of the given raw type."""
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    else:
        # 32 x 64 values of a type whose block is 32 values: raw bytes of the right size
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((32, 64 // block * size), np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    for name in extra:
        w.add_tensor(name, np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unsupported_quant_type(tmp_path):
    path = _gguf_with(tmp_path, qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(CheckpointError) as e:
        load_layer_range(open_checkpoint(path), 0, 1)
    msg = str(e.value)
    assert "token_embd.weight" in msg and "Q8_1" in msg and "bad.gguf" in msg


def test_gguf_unknown_architecture(tmp_path):
    path = _gguf_with(tmp_path, arch="rwkv6")
    with pytest.raises(CheckpointError, match="general.architecture='rwkv6'"):
        open_checkpoint(path)


def test_gguf_llama3_rope_factors_are_refused(tmp_path):
    """llama.cpp stores Llama 3.1+ rope scaling as a tensor; read without it, logits drift."""
    path = _gguf_with(tmp_path, extra=("rope_freqs.weight",))
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        open_checkpoint(path)


def test_gguf_missing_tensor(tmp_path):
    path = _gguf_with(tmp_path)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_norm\.weight.*missing"):
        load_layer_range(open_checkpoint(path), 0, 1)


def test_gguf_truncated(tmp_path, folder):
    path = write_tiny_gguf(folder, tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(path)
    path.write_bytes(b"GGUF" + data[4:200])
    with pytest.raises(CheckpointError, match="t.gguf"):
        open_checkpoint(path)
    shutil.copy(folder / "config.json", tmp_path / "notgguf.gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_checkpoint(tmp_path / "notgguf.gguf")
