"""Weights kept in their GGUF blocks: the torch dequantizers against gguf-py's, the tiled matmul
against dequantize-then-matmul, and whole tiny models (one file per kept type) loaded both ways.

The logits of a range loaded with `weights="quantized"` are compared with the same file loaded
with `weights="dequantize"` in float32 on the CPU: every dequantized value is bit-identical
(`test_dequantize_rows_is_gguf_bit_for_bit`), so the only difference left is the order of
float32 sums inside the matmul kernels (none in these shapes, where one tile is the whole
weight); the bound, 1e-5 of the logits' largest magnitude, is float32 rounding over K <= 512.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.checkpoint_gguf import permute_rows
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.layers.quant_linear import (
    ConcatLinear,
    QuantEmbedding,
    QuantLinear,
    concat_quant,
    quant_matmul,
)
from layersplit.shards.quant_blocks import (
    KEPT_TYPES,
    PLANAR_TYPES,
    dequantize_rows,
    planar_sections,
    random_blocks,
    to_planar,
)
from layersplit.shards.quant_plan import kept_bytes
from layersplit.shards.weights import layer_bytes, range_tensor_shapes

TYPES = list(KEPT_TYPES)
H, FF, HEADS, KV, VOCAB, LAYERS = 256, 512, 4, 2, 96, 3


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows_is_gguf_bit_for_bit(qtype):
    rng = np.random.default_rng(1)
    b = random_blocks(5, 768, qtype, rng)
    want = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
    got = dequantize_rows(torch.from_numpy(b), qtype).numpy()
    assert np.array_equal(got, want)


def _planar_values(rows: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """The values of planar rows (`quant_blocks.to_planar`), decoded from the layout as its
    docstring states it, with gguf's float32 expressions."""
    high, scales, words, _ = planar_sections(k, qtype)
    n, g = rows.shape[0], k // 32
    w = rows[:, :high].copy().view(np.uint32).reshape(n, g, 4, 1)  # (row, group, e, j)
    e = np.arange(4).reshape(1, 1, 4, 1)
    j = np.arange(8).reshape(1, 1, 1, 8)
    q = (w >> (4 * j).astype(np.uint32)) & 15
    if qtype == "Q5_K":
        qh = rows[:, high:scales].copy().view(np.uint32).reshape(n, g, 1, 1)
        q |= ((qh >> (4 * j + e).astype(np.uint32)) & 1) << 4
    elif qtype == "Q6_K":
        qh = rows[:, high:scales].copy().view(np.uint16).astype(np.uint32).reshape(n, g, 4, 1)
        bit = 2 * (j % 2) + 8 * ((j // 2) % 2) + 4 * (1 - j // 4)
        q |= ((qh >> bit.astype(np.uint32)) & 3) << 4
    sm = rows[:, scales:words].reshape(n, g, 2)
    dw = rows[:, words:words + k // 64].copy().view(np.float16).reshape(n, k // 256, 1, 2)
    dw = np.broadcast_to(dw, (n, k // 256, 8, 2)).reshape(n, g, 2).astype(np.float32)
    q = q.reshape(n, g, 32).astype(np.float32)  # (value r = 8e + j)
    if qtype == "Q6_K":
        sc = np.repeat(sm.view(np.int8).astype(np.float32), 16, axis=-1)
        return ((dw[..., :1] * sc) * (q - 32)).reshape(n, k)
    scale = (dw[..., 0] * sm[..., 0].astype(np.float32))[..., None]
    off = (dw[..., 1] * sm[..., 1].astype(np.float32))[..., None]
    return (scale * q - off).reshape(n, k)


@pytest.mark.parametrize("qtype", PLANAR_TYPES)
def test_planar_rows_hold_gguf_values_bit_for_bit(qtype):
    """The planar layout, decoded as documented, gives gguf's values exactly; its rows are the
    documented size, and a row's planar bytes depend on that row only (rows may be sliced,
    concatenated, gathered)."""
    b = random_blocks(5, 768, qtype, np.random.default_rng(3))
    flat = to_planar(torch.from_numpy(b), qtype)
    assert flat.shape == (5, planar_sections(768, qtype)[3]) and flat.shape[1] % 16 == 0
    want = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(_planar_values(flat.numpy(), qtype, 768), want)
    assert torch.equal(to_planar(torch.from_numpy(b[2:4]), qtype), flat[2:4])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_tiled_matmul_equals_dequantize_then_matmul(qtype):
    rng = np.random.default_rng(2)
    blocks = torch.from_numpy(random_blocks(37, 512, qtype, rng))  # (odd rows: a short tile)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(37)
    want = F.linear(x, dequantize_rows(blocks, qtype), bias)
    got = quant_matmul(x, blocks, qtype, 512, bias, tile_elements=512 * 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_concat_of_mixed_types_is_outputs_side_by_side():
    rng = np.random.default_rng(3)
    a = QuantLinear(torch.from_numpy(random_blocks(8, 256, "Q4_K", rng)), "Q4_K", 256)
    b = QuantLinear(torch.from_numpy(random_blocks(4, 256, "Q6_K", rng)), "Q6_K", 256)
    c = QuantLinear(torch.from_numpy(random_blocks(4, 256, "Q4_K", rng)), "Q4_K", 256)
    x = torch.randn(2, 256)
    for parts in ([a, b], [a, c]):
        fused = concat_quant(parts)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert isinstance(concat_quant([a, c]), QuantLinear)  # one type: the blocks concatenated
    fused = concat_quant([a, c, b])  # (q, k in Q4_K, v in Q6_K: two parts, q and k's joined)
    assert isinstance(fused, ConcatLinear) and len(fused.parts) == 2
    assert isinstance(fused.parts[0], QuantLinear) and fused.parts[0].out_features == 12
    assert torch.equal(fused(x), torch.cat([p(x) for p in (a, c, b)], dim=-1))
    fused = concat_quant([b, a, c])  # (the Q6_K first: its run, then the Q4_K run, in order)
    assert [p.out_features for p in fused.parts] == [4, 12]
    assert torch.equal(fused(x), torch.cat([p(x) for p in (b, a, c)], dim=-1))
    blocks = [p.blocks for p in (a, c)]
    ab, cb = (QuantLinear(t, "Q4_K", 256, torch.randn(t.shape[0])) for t in blocks)
    fused = concat_quant([ab, cb, c])  # (biases joined; a part without one stays apart)
    assert [p.out_features for p in fused.parts] == [12, 4]
    assert torch.equal(fused(x), torch.cat([p(x) for p in (ab, cb, c)], dim=-1))


def write_quant_gguf(path, qtype: str, *, tied: bool, seed: int = 0, embed: str | None = None):
    """A llama-architecture GGUF of `LAYERS` layers whose matrices are random `qtype` blocks
    (q/k rows stored permuted as llama.cpp's converter stores them) and F32 norms."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(H // HEADS)
    w.add_value_length(H // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)

    def matrix(name: str, rows: int, cols: int, t: str = qtype, heads: int = 0) -> None:
        b = random_blocks(rows, cols, t, rng, scale=0.5 if "token_embd" in name else 0.08)
        if heads:
            b = permute_rows(b, heads)
        w.add_tensor(name, b, raw_shape=b.shape, raw_dtype=gguf.GGMLQuantizationType[t])

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, H, embed or qtype)
    hd = H // HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * hd, H, heads=HEADS)
        matrix(f"blk.{i}.attn_k.weight", KV * hd, H, heads=KV)
        matrix(f"blk.{i}.attn_v.weight", KV * hd, H, "Q6_K" if qtype == "Q4_K" else qtype)
        matrix(f"blk.{i}.attn_output.weight", H, HEADS * hd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FF, H)
        matrix(f"blk.{i}.ffn_up.weight", FF, H)
        matrix(f"blk.{i}.ffn_down.weight", H, FF)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", VOCAB, H, "Q6_K" if qtype == "Q4_K" else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(path, weights: str, splits: list[tuple[int, int]],
            device: str = "cpu", fuse: bool = False) -> torch.Tensor:
    """Logits of a prefill then two decode steps through ranges `splits` chained in order
    (`fuse`: with the fused decode step a shard installs on a GPU, `shards.fused`)."""
    from layersplit.shards.fused import fuse_projections

    ckpt = open_checkpoint(path)
    ranges = [load_layer_range(ckpt, a, b, torch.float32, device, weights) for a, b in splits]
    for r in ranges if fuse else []:
        fuse_projections(r, compile=False)
    execs = [RangeExecutor(r, 64, device=device) for r in ranges]
    out = []
    for pos, tokens in ((0, [5, 17, 3, 88, 41, 9]), (6, [60]), (7, [2])):
        x = torch.tensor(tokens, device=device)
        for ex in execs:
            ex.before_step(0, pos, None)
            x = ex.run(x, pos)
        out.append(x)
    return torch.cat(out)


@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_kept_logits_equal_dequantized(tmp_path, qtype):
    path = write_quant_gguf(tmp_path / f"{qtype}.gguf", qtype, tied=qtype not in ("Q4_K",),
                            embed="Q8_0" if qtype == "Q4_1" else None)
    want = _logits(path, "dequantize", [(0, LAYERS)])
    assert want.std() > 0.5  # (logits that move: a wrong weight would show)
    got = _logits(path, "quantized", [(0, LAYERS)])
    tol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # each range reads its own layers' blocks; the split changes nothing
    split = _logits(path, "quantized", [(0, 1), (1, 3)])
    torch.testing.assert_close(split, want, rtol=0, atol=tol)


def test_kept_modules_and_their_bytes(tmp_path):
    path = write_quant_gguf(tmp_path / "m.gguf", "Q4_K", tied=True)
    ckpt = open_checkpoint(path)
    whole = load_layer_range(ckpt, 0, LAYERS, torch.float32, weights="quantized")
    assert isinstance(whole.embed_tokens, QuantEmbedding)
    assert isinstance(whole.lm_head, QuantLinear)  # tied: the embedding's blocks
    assert whole.lm_head.blocks is whole.embed_tokens.blocks
    attn = whole.layers[0].self_attn
    assert (attn.q_proj.qtype, attn.v_proj.qtype) == ("Q4_K", "Q6_K")
    cfg = ckpt.config
    per_layer, first, last = layer_bytes(cfg, 4, lambda s: kept_bytes(ckpt, cfg, s, 4))
    # the blocks at the larger of their stored and planar sizes (a GPU repacks K-quants), and
    # two float32 norms
    blocks = sum(m.blocks.shape[0] * max(m.blocks.shape[1], planar_sections(
        m.in_features, m.qtype)[3] if m.qtype in PLANAR_TYPES else 0)
        for m in whole.layers[1].modules() if isinstance(m, QuantLinear))
    assert per_layer[1] == blocks + 2 * H * 4
    assert blocks > sum(m.blocks.numel() for m in whole.layers[1].modules()
                        if isinstance(m, QuantLinear))
    assert first == VOCAB * max(H // 256 * 144, planar_sections(H, "Q4_K")[3])
    plain = layer_bytes(cfg, 4)
    assert plain[0][1] > 6 * per_layer[1]
    mid = load_layer_range(ckpt, 1, 2, torch.float32, weights="quantized")
    assert not hasattr(mid, "embed_tokens") or mid.embed_tokens is None
    assert set(range_tensor_shapes(cfg, 1, 2)) >= {"model.layers.1.mlp.up_proj.weight"}


def test_type_not_kept_is_refused_by_name(tmp_path):
    path = tmp_path / "q5_0.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                 ("feed_forward_length", 64), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", 32)
    q5 = gguf.GGMLQuantizationType.Q5_0
    for name, shape in (("token_embd.weight", (32, 64)), ("blk.0.attn_q.weight", (64, 64)),
                        ("blk.0.attn_k.weight", (64, 64)), ("blk.0.attn_v.weight", (64, 64)),
                        ("blk.0.attn_output.weight", (64, 64)),
                        ("blk.0.ffn_gate.weight", (64, 64)), ("blk.0.ffn_up.weight", (64, 64)),
                        ("blk.0.ffn_down.weight", (64, 64))):
        data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), q5)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q5)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = open_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' has type Q5_0.*dequantize"):
        load_layer_range(ckpt, 0, 1, torch.float32, weights="quantized")
    load_layer_range(ckpt, 0, 1, torch.float32)  # (dequantized at load, as before)


def test_weight_format_rule(tmp_path):
    from layersplit.runtime.config import ConfigError, RuntimeConfig
    from layersplit.shards.quant_plan import resolve_weight_format
    from layersplit.shards.tiny import write_tiny_checkpoint

    ckpt = open_checkpoint(write_quant_gguf(tmp_path / "m.gguf", "Q4_K", tied=True))
    # (auto dequantizes while the kernels are slower than the dequantized weights)
    assert resolve_weight_format("auto", ckpt, ["cuda:0", "cuda:1"])[0] == "dequantize"
    assert resolve_weight_format("auto", ckpt, ["cuda:0", "cpu"])[0] == "dequantize"
    assert resolve_weight_format("quantized", ckpt, ["cpu"])[0] == "quantized"
    hf = open_checkpoint(write_tiny_checkpoint(tmp_path / "hf", "llama", num_layers=1))
    assert resolve_weight_format("auto", hf, ["cuda:0"]) == (
        "dequantize", "not a GGUF file nor an FP8, GPTQ or AWQ checkpoint")
    with pytest.raises(CheckpointError, match="keeps a GGUF file's blocks or an FP8, GPTQ or AWQ "
                                              "checkpoint's values; this checkpoint has none"):
        resolve_weight_format("quantized", hf, ["cuda:0"])
    with pytest.raises(ConfigError, match="weight_format='int4'"):
        RuntimeConfig(weight_format="int4")


def test_float_matrices_stay_linears(tiny_llama, tmp_path):
    """An F16 file with weight_format quantized: nothing to keep, the same modules as
    dequantized."""
    from layersplit.shards.tiny import write_tiny_gguf

    ckpt = open_checkpoint(write_tiny_gguf(tiny_llama, tmp_path / "f16.gguf", "F16"))
    r = load_layer_range(ckpt, 0, 2, torch.float32, weights="quantized")
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in r.modules())


def test_moe_experts_kept_quantized_equal_dequantized(tmp_path, family="qwen3_moe"):
    """A MoE GGUF's stacked experts kept as Q8_0 blocks (the tiny Qwen3-MoE's widths are
    whole blocks of 32; the tiny Mixtral's and Qwen2-MoE's are not): the logits of the
    file dequantized at load, bit for bit (float32, the experts in the same order)."""
    from layersplit.shards.layers.quant_experts import QuantExperts
    from layersplit.shards.tiny import write_tiny_checkpoint, write_tiny_gguf

    folder = write_tiny_checkpoint(tmp_path / family, family, num_layers=2)
    path = write_tiny_gguf(folder, tmp_path / f"{family}.gguf", "Q8_0")
    r = load_layer_range(open_checkpoint(path), 0, 2, torch.float32, weights="quantized")
    assert isinstance(r.layers[1].mlp.experts, QuantExperts)
    want = _logits(path, "dequantize", [(0, 2)])
    got = _logits(path, "quantized", [(0, 1), (1, 2)])
    assert torch.equal(got, want)
