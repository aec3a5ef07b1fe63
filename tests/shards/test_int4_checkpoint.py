"""GPTQ and AWQ int4 checkpoints (`shards.int4`): the packed words unpack to known integers
(packed here with plain bit operations, in AutoGPTQ's and AutoAWQ's layouts); a tiny model
rounded to the int4 grid and stored packed loads, with a warning naming the memory cost, to the
very logits of the same model stored dense, whole and range by range (GPTQ with act order's
permuted groups too); and what is not implemented, in the config or the tensors, is refused by
name; kept in int4 (`weight_format = "quantized"`, `layers.int4_linear`) the logits are those of
dequantizing at load."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.int4 import Int4Scheme, dequantize_int4, part_shapes, repack_int4
from layersplit.shards.layers.int4_linear import Int4Linear, int4_matmul
from layersplit.shards.layers.quant_linear import ConcatLinear, concat_quant
from layersplit.shards.model_config import read_hf_config
from layersplit.shards.quant_plan import (
    AUTO_DEQUANTIZES_INT4,
    kept_bytes,
    kept_tensors,
    resolve_weight_format,
)
from layersplit.shards.tiny import write_tiny_checkpoint
from layersplit.shards.weights import range_tensor_shapes
from safetensors.torch import load_file, save_file

from tests.helpers import AWQ_ORDER, pack_cols, pack_rows, range_logits, write_int4

K, N, GROUP = 64, 48, 16
WORDS = np.array([[0x76543210, np.int32(-0x01234568)]], dtype=np.int64).astype(np.int32)
# (the second word is 0xFEDCBA98: its top nibble sets the sign bit)


def _known(seed: int, zmin: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (K, N))
    zero = rng.integers(zmin, 16, (K // GROUP, N))
    scale = rng.uniform(0.01, 1.0, (K // GROUP, N)).astype(np.float16)
    return q, zero, scale


def _want(q, zero, scale, g_idx) -> torch.Tensor:
    """(q - zero) * scale of each input row's group, as (N, K), in float32 (exact)."""
    w = (q - zero[g_idx]) * scale.astype(np.float64)[g_idx]
    return torch.from_numpy(w.T.astype(np.float32))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def test_packed_words_unpack_in_each_layout():
    """One word 0x76543210 (nibble i = i, low bits first) and one 0xFEDCBA98: GPTQ's qweight
    holds eight input rows of a column (its stored zeros one less); AWQ's eight output columns
    in the order [0, 2, 4, 6, 1, 3, 5, 7]."""
    qweight = np.zeros((1, 8), dtype=np.int32)
    qweight[0, :2] = WORDS[0]
    got = dequantize_int4(Int4Scheme("gptq", 8), {  # (zeros 8, stored as 7s)
        "x.qweight": _t(qweight), "x.qzeros": _t(np.array([[0x77777777]], dtype=np.int32)),
        "x.scales": _t(np.ones((1, 8), dtype=np.float16)),
        "x.g_idx": _t(np.zeros(8, dtype=np.int32))}, "x", torch.float32)
    assert (got[:2] + 8).tolist() == [list(range(8)), list(range(8, 16))]
    qweight = np.zeros((8, 1), dtype=np.int32)  # (K: a whole word of eight input rows)
    qweight[:2] = WORDS.reshape(2, 1)
    got = dequantize_int4(Int4Scheme("awq", 1), {
        "x.qweight": _t(qweight), "x.qzeros": _t(np.zeros((8, 1), dtype=np.int32)),
        "x.scales": _t(np.ones((8, 8), dtype=np.float16))}, "x", torch.float32)
    assert got.t()[:2].tolist() == [[0, 4, 1, 5, 2, 6, 3, 7], [8, 12, 9, 13, 10, 14, 11, 15]]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_dequantizes_to_the_known_values(act_order):
    q, zero, scale = _known(1, 1)
    g_idx = np.arange(K) // GROUP
    if act_order:
        g_idx = g_idx[np.random.default_rng(2).permutation(K)]
    parts = {"x.qweight": _t(pack_rows(q)), "x.qzeros": _t(pack_cols(zero - 1)),
             "x.scales": _t(scale), "x.g_idx": _t(g_idx.astype(np.int32))}
    want = _want(q, zero, scale, g_idx)
    scheme = Int4Scheme("gptq", GROUP, act_order)
    assert torch.equal(dequantize_int4(scheme, parts, "x", torch.float32), want)
    assert torch.equal(dequantize_int4(scheme, parts, "x", torch.bfloat16),
                       want.to(torch.bfloat16))


def test_awq_dequantizes_to_the_known_values():
    q, zero, scale = _known(3, 0)
    parts = {"x.qweight": _t(pack_cols(q, AWQ_ORDER)), "x.qzeros": _t(pack_cols(zero, AWQ_ORDER)),
             "x.scales": _t(scale)}
    want = _want(q, zero, scale, np.arange(K) // GROUP)
    assert torch.equal(dequantize_int4(Int4Scheme("awq", GROUP), parts, "x", torch.float32),
                       want)


def test_large_weights_dequantize_a_slice_at_a_time(monkeypatch):
    import layersplit.shards.int4 as int4

    q, zero, scale = _known(4, 1)
    parts = {"x.qweight": _t(pack_rows(q)), "x.qzeros": _t(pack_cols(zero - 1)),
             "x.scales": _t(scale), "x.g_idx": _t((np.arange(K) // GROUP).astype(np.int32))}
    whole = dequantize_int4(Int4Scheme("gptq", GROUP), parts, "x", torch.float32)
    monkeypatch.setattr(int4, "_CHUNK", 8 * N)  # (8 input rows a slice)
    assert torch.equal(dequantize_int4(Int4Scheme("gptq", GROUP), parts, "x", torch.float32),
                       whole)


@pytest.mark.parametrize("method, family, act_order", [
    ("gptq", "llama", True), ("gptq", "qwen3_moe", False), ("gptq", "deepseek_v3", True),
    ("awq", "llama", False), ("awq", "qwen3_moe", False), ("awq", "deepseek_v3", False)])
def test_int4_checkpoint_loads_as_its_dequantized_weights(method, family, act_order, tmp_path,
                                                          caplog):
    """(qwen3_moe: experts stored per expert, each packed; deepseek_v3: latent attention's
    projections, 24 input columns in groups of 8, `kv_b_proj` read whole; the LM head and
    embedding stay dense, as `modules_to_not_convert` leaves them)"""
    dense = write_tiny_checkpoint(tmp_path / "dense", family, num_layers=3)
    packed = write_int4(dense, tmp_path / method, method, group=8 if family == "deepseek_v3"
                        else 32, act_order=act_order)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    caplog.set_level(logging.WARNING, logger="layersplit.shards.checkpoint_hf")
    want = range_logits(dense, ids)
    for split in ((0, 3), (0, 1, 3)):
        assert torch.equal(range_logits(packed, ids, split), want), split
    assert f"{method.upper()} int4 tensors dequantized at load to float32" in caplog.text


def _edit(folder: Path, **quant) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {k: v for k, v in {**raw["quantization_config"],
                                                    **quant}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("int4")
    dense = write_tiny_checkpoint(tmp / "dense", "llama", num_layers=2)
    return {m: write_int4(dense, tmp / m, m, act_order=m == "gptq") for m in ("gptq", "awq")}


def _copy(packed: dict[str, Path], method: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(packed[method], tmp_path / method))


@pytest.mark.parametrize("method, quant, named", [
    ("gptq", {"bits": 8}, "bits=8 is not implemented for quant_method 'gptq' (only 4)"),
    ("awq", {"bits": 3}, "bits=3 is not implemented for quant_method 'awq'"),
    ("gptq", {"bits": None}, "bits=None is not implemented"),
    ("gptq", {"checkpoint_format": "gptq_v2"}, "checkpoint_format=['gptq_v2'] is not"),
    ("gptq", {"checkpoint_format": None, "format": "marlin"}, "checkpoint_format=['marlin']"),
    ("gptq", {"is_marlin_format": True}, "is_marlin_format=True is not implemented"),
    ("gptq", {"dynamic": {"-:.*down": {}}}, "dynamic={'-:.*down': {}} is not implemented"),
    ("gptq", {"pack_dtype": "int16"}, "pack_dtype='int16' is not implemented"),
    ("gptq", {"adapter": {"name": "lora"}}, "adapter={'name': 'lora'} is not implemented"),
    ("gptq", {"rotation": "hadamard"}, "rotation='hadamard' is not implemented"),
    ("gptq", {"bits": 4, "group_size": None}, "group_size=None must be a positive integer"),
    ("gptq", {"group_size": 0}, "group_size=0 must be a positive integer or -1"),
    ("gptq", {"weird": 1}, "field(s) ['weird'] are not implemented for quant_method 'gptq'"),
    ("awq", {"version": "gemv"}, "version=['gemv'] is not implemented for quant_method 'awq'"),
    ("awq", {"version": "marlin"}, "version=['marlin'] is not implemented"),
    ("awq", {"version": None}, "version=None is not implemented"),
    ("awq", {"zero_point": False}, "zero_point=False is not implemented"),
    ("awq", {"desc_act": True}, "field(s) ['desc_act'] are not implemented for quant_method"),
])
def test_an_unimplemented_int4_config_is_refused_by_name(packed, tmp_path, method, quant,
                                                         named):
    with pytest.raises(CheckpointError, match="quantization_config") as e:
        read_hf_config(_edit(_copy(packed, method, tmp_path), **quant))
    assert named in str(e.value)


def test_what_an_int4_config_may_say(packed, tmp_path):
    """optimum's and AutoAWQ's published keys; group_size -1 (one group: the whole K); GPTQ
    without `g_idx` where desc_act is off (groups of consecutive rows)."""
    read_hf_config(_edit(_copy(packed, "gptq", tmp_path), use_exllama=True, format="GPTQ",
                         exllama_config={"version": 1}, model_seqlen=None, meta={}))
    read_hf_config(_edit(_copy(packed, "awq", tmp_path), backend="autoawq", do_fuse=False,
                         fuse_max_seq_len=None, version="GEMM"))
    dense = write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2)
    ids = torch.arange(1, 13)
    for method in ("gptq", "awq"):
        folder = write_int4(dense, tmp_path / f"whole-{method}", method, group=-1)
        assert torch.equal(range_logits(folder, ids), range_logits(dense, ids)), method
    no_g_idx = write_int4(dense, tmp_path / "no-g_idx", "gptq")
    _rewrite(no_g_idx, lambda t: [t.pop(n) for n in list(t) if n.endswith(".g_idx")])
    assert torch.equal(range_logits(no_g_idx, ids), range_logits(dense, ids))


def _rewrite(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


P = "model.layers.1.mlp.down_proj"  # (K = 160 input columns, N = 64 outputs)
BAD = {
    "no qzeros": ("gptq", lambda t: t.pop(P + ".qzeros"), f"tensor '{P}.qzeros' is missing"),
    "no scales": ("awq", lambda t: t.pop(P + ".scales"), f"tensor '{P}.scales' is missing"),
    "no g_idx under desc_act": ("gptq", lambda t: t.pop(P + ".g_idx"),
                                f"tensor '{P}.g_idx' is missing"),
    "scales shape": ("gptq", lambda t: t.update(
        {P + ".scales": t[P + ".scales"][:, :32].contiguous()}),
                     f"'{P}.scales' has shape (5, 32), expected (5, 64)"),
    "qweight shape": ("awq", lambda t: t.update({P + ".qweight": t[P + ".qweight"][:80]}),
                      f"'{P}.qweight' has shape (80, 8), expected (160, 8)"),
    "qweight dtype": ("gptq", lambda t: t.update({P + ".qweight": t[P + ".qweight"].float()}),
                      f"'{P}.qweight' is stored as torch.float32, not int32"),
    "integer scales": ("awq", lambda t: t.update({P + ".scales": t[P + ".scales"].int()}),
                       "int4 scales must be floats"),
    "g_idx range": ("gptq", lambda t: t.update({P + ".g_idx": t[P + ".g_idx"] + 1}),
                    f"'{P}.g_idx' names groups outside 0...4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_int4_tensors_are_refused_by_name(packed, tmp_path, case):
    method, edit, named = BAD[case]
    folder = _copy(packed, method, tmp_path)
    _rewrite(folder, edit)
    with pytest.raises(CheckpointError) as e:
        load_layer_range(open_checkpoint(folder), 0, 2)
    assert named in str(e.value), (case, str(e.value))


def test_a_group_size_that_does_not_divide_k_is_refused_by_name(packed, tmp_path):
    folder = _edit(_copy(packed, "awq", tmp_path), group_size=48)
    with pytest.raises(CheckpointError, match="quantization_config group_size 48 does not "
                                              "divide its 64 input columns") as e:
        load_layer_range(open_checkpoint(folder), 0, 2)
    assert "'model.layers.0.self_attn.q_proj.qweight'" in str(e.value)


def test_kept_int4_is_taken_when_asked_and_auto_dequantizes(packed, tmp_path):
    ckpt = open_checkpoint(packed["gptq"])
    assert resolve_weight_format("quantized", ckpt, ["cpu"])[0] == "quantized"
    assert resolve_weight_format("auto", ckpt, ["cuda:0"]) == ("dequantize",
                                                                AUTO_DEQUANTIZES_INT4)
    raw = json.loads((packed["awq"] / "config.json").read_text())
    folder = _copy(packed, "awq", tmp_path)
    del raw["quantization_config"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="is int4 but config.json has no "
                                              "quantization_config with quant_method"):
        load_layer_range(open_checkpoint(folder), 0, 2)


def test_a_k_of_part_words_is_refused_by_name():
    with pytest.raises(CheckpointError, match="'x.qweight': a weight of shape \\(8, 12\\) does "
                                              "not pack into words of eight 4-bit values"):
        part_shapes(Int4Scheme("awq", -1), "x", (8, 12))


@pytest.mark.parametrize("method, family, act_order", [
    ("gptq", "llama", True), ("awq", "qwen3_moe", False), ("gptq", "deepseek_v3", True)])
def test_kept_in_int4_gives_the_dequantized_logits(method, family, act_order, tmp_path):
    """`weight_format = "quantized"`: the projections stay int4 (`Int4Linear`, about half a byte
    a value; a MoE layer's experts and latent attention's `kv_b_proj` are dequantized), the
    logits those of dequantizing at load (float32 on a CPU: the same values, each projection
    one tile), whole and range by range; the memory plan counts their bytes as they are held."""
    dense = write_tiny_checkpoint(tmp_path / "dense", family, num_layers=3)
    packed = write_int4(dense, tmp_path / method, method,
                        group=8 if family == "deepseek_v3" else 32, act_order=act_order)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(4))
    want = range_logits(dense, ids)
    for split in ((0, 3), (0, 1, 3)):
        assert torch.equal(range_logits(packed, ids, split, "quantized"), want), split
    ckpt = open_checkpoint(packed)
    model = load_layer_range(ckpt, 0, 3, weights="quantized")
    kept = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(kept) == {"llama": 3 * 7, "qwen3_moe": 3 * 4 + 3,  # (q/k/v/o, dense MLPs)
                         "deepseek_v3": 3 * 3 + 3 + 2 * 3}[family]  # (as FP8's)
    assert all((m.g_idx is not None) == act_order for m in kept.values())
    shapes = range_tensor_shapes(ckpt.config, 0, 3)
    names = kept_tensors(ckpt, ckpt.config, shapes)
    held = sum(b.numel() * b.element_size() for m in kept.values() for b in m.buffers())
    assert kept_bytes(ckpt, ckpt.config, {n: shapes[n] for n in names}, 4) == held


def test_int4_linear_tiles_and_concatenation():
    """A projection dequantized a tile of rows at a time gives the one-tile result; q/k/v of
    one act order concatenate into one `Int4Linear` (the GEMV's one launch), of two into a
    `ConcatLinear`."""
    def linear(seed: int, act_order: bool) -> Int4Linear:
        q, zero, scale = _known(seed, 1)
        g_idx = np.arange(K) // GROUP
        if act_order:
            g_idx = g_idx[np.random.default_rng(2).permutation(K)]
        parts = {"x.qweight": _t(pack_rows(q)), "x.qzeros": _t(pack_cols(zero - 1)),
                 "x.scales": _t(scale), "x.g_idx": _t(g_idx.astype(np.int32))}
        return Int4Linear(repack_int4(Int4Scheme("gptq", GROUP, act_order), parts, "x"))

    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    lin = linear(5, True)
    whole = lin(x)
    torch.testing.assert_close(int4_matmul(x, lin.weight4, tile_elements=8 * K), whole,
                               rtol=1e-6, atol=1e-6)
    parts = [linear(s, True) for s in (6, 7, 8)]
    fused = concat_quant(parts)
    assert isinstance(fused, Int4Linear) and fused.out_features == 3 * N
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert isinstance(concat_quant([linear(6, True), linear(7, False)]), ConcatLinear)


def test_quantize_int4_rounds_each_group_onto_its_grid():
    """`int4.quantize_int4` (random-weight int4 shapes): values already on a group's 16 steps
    come back exactly; others within half a step."""
    from layersplit.shards.int4 import dequantize_packed, quantize_int4

    g = torch.Generator().manual_seed(0)
    scale = torch.rand(N, K // GROUP, generator=g) + 0.1
    zero = torch.randint(0, 16, (N, K // GROUP), generator=g).float()
    q = torch.randint(0, 16, (N, K), generator=g).float()
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15  # (each group spans the whole range)
    exact = (q - zero.repeat_interleave(GROUP, 1)) * scale.repeat_interleave(GROUP, 1)
    w = quantize_int4(exact, GROUP)
    back = dequantize_packed(w.qweight, w.zeros, w.scales, w.g_idx, w.group, torch.float32)
    torch.testing.assert_close(back, exact, rtol=1e-5, atol=1e-5)
    noisy = torch.randn(N, K, generator=g)
    w = quantize_int4(noisy, -1)
    back = dequantize_packed(w.qweight, w.zeros, w.scales, w.g_idx, w.group, torch.float32)
    assert w.group == K and ((back - noisy).abs() <= w.scales / 2 + 1e-6).all()


def test_a_random_weight_int4_shape_keeps_its_projections(tmp_path):
    """`random:` shapes whose config says GPTQ (`configs/models/llama-8b-int4`, for speed): the
    projections' random values rounded to int4 and kept so; the decode runs."""
    from layersplit.shards.executor import RangeExecutor
    from layersplit.shards.random_weights import RandomCheckpoint

    folder = tmp_path / "shape"
    packed = write_int4(write_tiny_checkpoint(tmp_path / "dense", "llama", num_layers=2),
                        tmp_path / "int4", "gptq")
    folder.mkdir()
    shutil.copy(packed / "config.json", folder / "config.json")
    ckpt = RandomCheckpoint(folder, std=0.2)
    assert ckpt.keeps_quantized and ckpt.kept_type("model.layers.0.mlp.up_proj.weight") == "INT4"
    assert ckpt.kept_type("lm_head.weight") is None
    model = load_layer_range(ckpt, 0, 2, weights="quantized")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2 * 7
    logits = RangeExecutor(model, max_len=64).run(torch.arange(1, 9), 0, all_logits=True)
    assert logits.shape == (8, 320) and torch.isfinite(logits).all()
    big = open_checkpoint("random:llama-8b-int4")
    assert big.int4.group_size == 128 and big.kept_type("model.layers.0.self_attn.q_proj.weight")
