"""A GGUF file's block types are dequantized in torch at load (`GGUFFile._read_on`, on the
device the weights go to): the weights, in every run dtype, are bit for bit those of gguf-py's
numpy dequantization, q/k rows un-permuted and 3-D expert tensors included."""

from __future__ import annotations

import pytest
import torch
from gguf.quants import dequantize
from layersplit.shards import checkpoint_gguf
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf


def _both(path, start: int, end: int, dtype: torch.dtype, monkeypatch, device: str = "cpu"):
    got = load_layer_range(open_checkpoint(path), start, end, dtype=dtype, device=device)
    with monkeypatch.context() as m:  # the numpy path, with gguf-py's own dequantize
        m.setattr(checkpoint_gguf.GGUFFile, "_read_on", lambda *a: None)
        m.setattr(checkpoint_gguf, "_dequantize", dequantize)
        want = load_layer_range(open_checkpoint(path), start, end, dtype=dtype, device=device)
    return got.state_dict(), want.state_dict()


def _assert_same_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 24, 100, 192], ids=["whole", "row-chunks",
                                                        "row-chunks-3"])
def test_dense_gguf_loads_gguf_py_values(tmp_path, monkeypatch, qtype, dtype, chunk):
    # (100: a row a chunk of the tiny model's 64- and 160-wide rows; 192: 3 rows of 64 a chunk,
    # and a last chunk that is not full)
    monkeypatch.setattr(checkpoint_gguf, "DEQUANT_CHUNK_VALUES", chunk)
    folder = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / f"m-{qtype}.gguf", qtype)
    _assert_same_bits(*_both(path, 0, 2, dtype, monkeypatch))


def test_moe_gguf_experts_load_gguf_py_values(tmp_path, monkeypatch):
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen3_moe", num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / "m-q8.gguf", "Q8_0")
    got, want = _both(path, 1, 2, torch.float32, monkeypatch)
    assert got["layers.0.mlp.experts.gate_proj"].shape == (8, 32, 64)
    _assert_same_bits(got, want)


def test_a_header_is_shared_while_held_and_freed_after(tmp_path):
    """`read_header` parses a file once while a reader holds it (the coordinator's three reads),
    and holds nothing itself: a shard that has loaded its layers keeps neither the file's map nor
    its vocabulary."""
    import gc

    from layersplit.shards import gguf_header

    folder = write_tiny_checkpoint(tmp_path / "m", "llama", num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    first = gguf_header.read_header(path)
    assert gguf_header.read_header(path) is first
    load_layer_range(open_checkpoint(path), 0, 2, dtype=torch.float32)
    del first
    gc.collect()
    assert not [k for k in gguf_header._OPENED.keys() if k[0] == str(path.resolve())]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("lead", [(3,), (2, 3)])  # (a matrix's rows; experts' rows)
def test_every_kept_type_dequantizes_as_gguf_py(qtype, lead):
    """`checkpoint_gguf._dequantize` on every block type it runs in torch, a matrix and a 3-D
    stack of experts, against gguf-py's numpy on the same bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from layersplit.shards.quant_blocks import KEPT_TYPES, random_blocks

    t = KEPT_TYPES[qtype]
    rows, cols = int(np.prod(lead)), 2 * t.block
    raw = random_blocks(rows, cols, qtype, np.random.default_rng(7)).reshape(*lead, -1)
    q = GGMLQuantizationType[qtype]
    got, want = checkpoint_gguf._dequantize(raw, q), dequantize(raw, q)
    assert got.shape == want.shape == (*lead, cols)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
