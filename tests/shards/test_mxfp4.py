"""gpt-oss's MXFP4 experts: dequantized as transformers dequantizes them, and a checkpoint that
stores them so loads (with a warning naming the memory cost) to the same logits as one that
stores the dequantized weights."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.mxfp4 import dequantize_mxfp4
from layersplit.shards.tiny import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _packed(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks and scales (exponents 2^-5..2^-2) for a (E, R, C) weight."""
    e, r, c = shape
    blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 126, (e, r, c // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_as_transformers(dtype):
    blocks, scales = _packed((3, 8, 64), torch.Generator().manual_seed(0))
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 64, 8) and torch.equal(got, want)


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path, caplog):
    dense = write_tiny_checkpoint(tmp_path / "dense", "gpt_oss", num_layers=2)
    packed = tmp_path / "packed"
    shutil.copytree(dense, packed)
    gen = torch.Generator().manual_seed(1)
    tensors = load_file(str(dense / "model.safetensors"))
    quantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, c, r = tensors[name].shape
        blocks, scales = _packed((e, r, c), gen)
        tensors[name] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(dense / "model.safetensors"))
    save_file({**{k: v for k, v in tensors.items() if f"{k}_blocks" not in quantized},
               **quantized}, str(packed / "model.safetensors"))
    raw = json.loads((packed / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(raw))
    ids = torch.randint(0, 320, (20,), generator=gen)
    logits = []
    caplog.set_level(logging.WARNING, logger="layersplit.shards.checkpoint_hf")
    for folder in (dense, packed):
        ckpt = open_checkpoint(folder)
        logits.append(RangeExecutor(load_layer_range(ckpt, 0, 2), max_len=64).run(
            ids, 0, all_logits=True))
    assert torch.equal(logits[0], logits[1])
    # 4 tensors: 17 bytes per 32 weights stored, 4 bytes a weight in float32
    assert "4 MXFP4 expert tensors dequantized at load to float32" in caplog.text
    assert "(7.5 x)" in caplog.text
