"""FP8 checkpoints (`quant_method = "fp8"`, float8 e4m3 weights with block scales): dequantized as
transformers dequantizes them; a checkpoint so stored loads (with a warning naming the memory
cost) to the very logits of one storing the dequantized weights, whole and range by range, with
experts stored per expert and partial blocks (DeepSeek-V3's layout); transformers' own load of
the FP8 folder gives our logits; and what we do not implement in one is refused by name."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fp8 import dequantize_fp8, quantize_fp8, scale_shape
from layersplit.shards.layers.fp8_linear import Fp8Linear
from layersplit.shards.layers.quant_linear import concat_quant
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.quant_plan import kept_bytes, kept_tensors
from layersplit.shards.tiny import write_tiny_checkpoint
from layersplit.shards.weights import range_tensor_shapes
from safetensors.torch import load_file, save_file

from tests.helpers import range_logits, write_fp8

BLOCK = (16, 32)  # (tiny models' sides: whole blocks, but for DeepSeek-V3's 24 and 40 rows)


def test_dequantized_as_transformers():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8(w, BLOCK)
    for dtype in (torch.float32, torch.bfloat16):
        want = fp8.Fp8Dequantize(None)._dequantize_one(q, s, dtype)
        assert torch.equal(dequantize_fp8(q, s, BLOCK, dtype), want)
    assert (dequantize_fp8(q, s, BLOCK, torch.float32) - w).abs().max() < 0.07 * w.abs().max()


def test_partial_blocks_take_their_own_scale():
    q = torch.full((40, 70), 1.0).to(torch.float8_e4m3fn)
    s = torch.arange(1, 1 + 3 * 3, dtype=torch.float32).reshape(3, 3)  # ceil(40/16), ceil(70/32)
    got = dequantize_fp8(q, s, BLOCK, torch.float32)
    want = torch.tensor([[s[r // 16, c // 32].item() for c in range(70)] for r in range(40)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(family, tmp_path, caplog):
    """(qwen3_moe: experts stored per expert, each with its scales; deepseek_v3: projections of
    24 and 40 rows, blocks cut short)"""
    dense = write_tiny_checkpoint(tmp_path / "dense", family, num_layers=3)
    packed = write_fp8(dense, tmp_path / "fp8")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    caplog.set_level(logging.WARNING, logger="layersplit.shards.checkpoint_hf")
    want = range_logits(dense, ids)
    assert "FP8" not in caplog.text
    for split in ((0, 3), (0, 1, 3), (0, 1, 2, 3)):
        assert torch.equal(range_logits(packed, ids, split), want), split
    assert "FP8 tensors dequantized at load to float32" in caplog.text
    assert "weight_format = quantized keeps the projections a layer reads" in caplog.text


def test_transformers_reads_the_fp8_folder_as_we_do(tmp_path):
    transformers = pytest.importorskip("transformers")
    packed = write_fp8(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=3),
                       tmp_path / "fp8")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32).eval()
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # (dequantized)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = range_logits(packed, ids)
    assert (ours - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def _edit(folder: Path, **quant) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **quant}
    raw["quantization_config"] = {k: v for k, v in raw["quantization_config"].items()
                                  if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not implemented"),
    ({"quant_method": "compressed-tensors"},
     "quant_method='compressed-tensors' is not implemented"),
    ({"fmt": "e5m2"}, "fmt='e5m2' is not implemented"),
    ({"activation_scheme": "static"}, "activation_scheme='static' is not implemented"),
    ({"weight_block_size": [128]}, "weight_block_size=[128] must be two positive integers"),
    ({"group_size": 128}, "['group_size'] are not implemented"),
    ({"scale_fmt": "e4m3"}, "scale_fmt='e4m3' is not implemented"),
])
def test_an_unimplemented_quantization_config_is_refused_by_name(tmp_path, quant, named):
    packed = write_fp8(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2),
                       tmp_path / "fp8")
    with pytest.raises(CheckpointError, match="quantization_config") as e:
        read_hf_config(_edit(packed, **quant))
    assert named in str(e.value)


def test_what_an_fp8_config_may_say(tmp_path):
    """DeepSeek-V3.1's `scale_fmt` (its kernels' activation scales; the stored scales are
    floats), any case of `dynamic`; and float8 weights under a config that does not say FP8."""
    packed = write_fp8(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2),
                       tmp_path / "fp8")
    read_hf_config(_edit(packed, scale_fmt="ue8m0", activation_scheme="Dynamic"))
    raw = json.loads((packed / "config.json").read_text())
    del raw["quantization_config"]
    (packed / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="is stored as torch.float8_e4m3fn, but config.json "
                                              "has no quantization_config with quant_method"):
        load_layer_range(open_checkpoint(packed), 0, 2)


def test_stacked_experts_dequantize_one_at_a_time():
    w = torch.randn(3, 40, 70, generator=torch.Generator().manual_seed(3))
    parts = [quantize_fp8(w[i], BLOCK) for i in range(3)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    got = dequantize_fp8(q, s, BLOCK, torch.bfloat16)
    assert torch.equal(got, torch.stack([dequantize_fp8(*p, BLOCK, torch.bfloat16)
                                         for p in parts]))


def _rewrite(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_bad_fp8_tensors_are_refused_by_name(tmp_path):
    dense = write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2)
    name = "model.layers.1.mlp.down_proj.weight"
    cases = {
        "no scale": (lambda t: t.pop(name + "_scale_inv"),
                     f"{name!r} is stored as torch.float8_e4m3fn, without a "
                     f"'{name}_scale_inv' beside it"),
        "scale shape": (lambda t: t.update(
            {name + "_scale_inv": t[name + "_scale_inv"][:, :2].contiguous()}),
                        f"'{name}_scale_inv' has shape (4, 2), expected (4, 5)"),
        "integer scales": (lambda t: t.update({name + "_scale_inv": torch.ones(
            4, 5, dtype=torch.uint8)}), "FP8 block scales must be floats"),
        "not float8": (lambda t: t.update({name: t[name].float()}),
                       "is stored as torch.float32, not float8_e4m3fn"),
    }
    good = write_fp8(dense, tmp_path / "fp8")
    for case, (edit, named) in cases.items():
        packed = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, packed)
        _rewrite(packed, edit)
        with pytest.raises(CheckpointError) as e:
            load_layer_range(open_checkpoint(packed), 0, 2)
        assert named in str(e.value), (case, str(e.value))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_kept_in_fp8_gives_the_dequantized_logits(family, tmp_path):
    """`weight_format = "quantized"`: the projections stay FP8 (`Fp8Linear`, a byte a value;
    a MoE layer's experts are dequantized), the logits those of dequantizing at load (float32
    on a CPU: the same values, each projection one tile), whole and range by range."""
    dense = write_tiny_checkpoint(tmp_path / "dense", family, num_layers=3)
    packed = write_fp8(dense, tmp_path / "fp8")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(4))
    want = range_logits(dense, ids)
    for split in ((0, 3), (0, 1, 3)):
        assert torch.equal(range_logits(packed, ids, split, "quantized"), want), split
    model = load_layer_range(open_checkpoint(packed), 0, 3, weights="quantized")
    kept = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(kept) == {"llama": 3 * 7, "qwen3_moe": 3 * 4 + 3,  # (q/k/v/o, dense MLPs)
                         "deepseek_v3": 3 * 3 + 3 + 2 * 3}[family]  # (q_a/q_b/o, the dense
    # layer's MLP, each sparse layer's shared expert; kv_a_proj_with_mqa, and kv_b read whole
    # by the absorbed attention: dequantized)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept)


def test_kept_fp8_bytes_and_fused_projections(tmp_path):
    """The memory plan counts a byte a kept value and a float32 a block; q/k/v and gate/up
    fuse into one `Fp8Linear` each (whole blocks of rows), with the same output."""
    dense = write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2)
    ckpt = open_checkpoint(write_fp8(dense, tmp_path / "fp8"))
    cfg = ckpt.config
    shapes = range_tensor_shapes(cfg, 0, 2)
    kept = kept_tensors(ckpt, cfg, shapes)
    assert set(kept.values()) == {"FP8"} and len(kept) == 2 * 7
    want = sum(math.prod(s) * (1 if n in kept else 4) for n, s in shapes.items()) + sum(
        4 * math.prod(scale_shape(shapes[n], BLOCK)) for n in kept)
    assert kept_bytes(ckpt, cfg, shapes, 4) == want
    model = load_layer_range(ckpt, 0, 2, weights="quantized")
    attn = model.layers[0].self_attn
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    want_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    fused = concat_quant([attn.q_proj, attn.k_proj, attn.v_proj])
    assert isinstance(fused, Fp8Linear) and torch.equal(fused(x), want_qkv)


def test_kept_fp8_on_a_checkpoint_without_it_is_refused_by_name(tmp_path):
    from layersplit.shards.quant_plan import resolve_weight_format

    ckpt = open_checkpoint(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2))
    with pytest.raises(CheckpointError, match="this checkpoint has none of them"):
        resolve_weight_format("quantized", ckpt, ["cpu"])
    packed = open_checkpoint(write_fp8(tmp_path / "dense", tmp_path / "fp8"))
    assert resolve_weight_format("quantized", packed, ["cpu"])[0] == "quantized"
    assert resolve_weight_format("auto", packed, ["cuda:0"])[0] == "dequantize"


def test_a_random_weight_fp8_shape_keeps_its_projections(tmp_path):
    """`random:` shapes whose config says FP8 (`configs/models/llama-8b-fp8`, for speed): the
    projections' random values quantized and kept in FP8; the decode runs."""
    from layersplit.shards.random_weights import RandomCheckpoint

    folder = tmp_path / "shape"
    packed = write_fp8(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2),
                       tmp_path / "fp8")
    folder.mkdir()
    shutil.copy(packed / "config.json", folder / "config.json")
    ckpt = RandomCheckpoint(folder, std=0.2)
    assert ckpt.keeps_quantized and ckpt.kept_type("model.layers.0.mlp.up_proj.weight") == "FP8"
    model = load_layer_range(ckpt, 0, 2, weights="quantized")
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 2 * 7
    logits = RangeExecutor(model, max_len=64).run(torch.arange(1, 9), 0, all_logits=True)
    assert logits.shape == (8, 320) and torch.isfinite(logits).all()
    assert open_checkpoint("random:llama-8b-fp8").fp8.block == (128, 128)


def test_weights_read_from_a_file_lie_aligned_as_dequantized_ones(tiny_llama, tmp_path):
    """A dense checkpoint's weights, read in place from its safetensors file, sit at their file
    offsets (8 past a multiple of 64 there): CPU matmul kernels on such operands sum in another
    order than on the 64-byte aligned tensors an FP8 checkpoint dequantizes into (AVX-512
    machines: logits 7e-6 apart on the same values). So every weight read lies aligned, and the
    two checkpoints give the same logits on any CPU."""
    dense = tmp_path / "dense"
    shutil.copytree(tiny_llama, dense)
    fp8 = write_fp8(dense, tmp_path / "fp8")
    for path in (dense, fp8):
        ckpt = open_checkpoint(path)
        model = load_layer_range(ckpt, 0, ckpt.config.num_layers, torch.float32, "cpu")
        odd = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
               if t.data_ptr() % 64]
        assert not odd, (path.name, odd[:4])
