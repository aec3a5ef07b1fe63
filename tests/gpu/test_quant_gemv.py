"""The kernels over weights kept in GGUF blocks (`shards.kernels.quant_gemv`) against gguf-py's
dequantize then a float32 matmul, for every kept type, odd shapes and 1 to 16 rows; and a whole
tiny model on the device loaded both ways.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: the dequantized values within 1 float32 ulp of
gguf's (the compiler may contract `d * q - m` into an FMA); products within 1e-5 (float32) or
1e-2 (bf16 activations, the output rounded once) of the result's largest magnitude.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.quant_blocks import KEPT_TYPES, PLANAR_TYPES, random_blocks, to_planar

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
TYPES = list(KEPT_TYPES)


def _case(qtype: str, n: int, k: int, seed: int = 0):
    b = random_blocks(n, k, qtype, np.random.default_rng(seed))
    ref = torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype]))
    return torch.from_numpy(b).to(DEV), ref.to(DEV)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_kernel_equals_gguf(qtype):
    from layersplit.shards.kernels.quant_gemv import dequantize

    blocks, ref = _case(qtype, 19, 768)
    got = dequantize(blocks, qtype, 768, torch.float32)
    torch.testing.assert_close(got, ref, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("qtype", PLANAR_TYPES)
def test_planar_dequantize_kernel_equals_gguf(qtype):
    from layersplit.shards.kernels.quant_gemv import dequantize

    blocks, ref = _case(qtype, 19, 768)
    got = dequantize(to_planar(blocks, qtype), qtype, 768, torch.float32, planar=True)
    torch.testing.assert_close(got, ref, rtol=2 ** -23, atol=0)


# (rows, outputs, inputs): a row of 576 (the default model's) is whole blocks of 32 only; 1280
# and 1312 take 4 super blocks an iteration (`SB`) with the last iteration partly past the row
CASES = [(q, *shape) for q in TYPES
         for shape in [(1, 37, 512), (3, 64, 768), (16, 5, 256), (2, 9, 576), (2, 9, 1280),
                       (1, 7, 1312)]
         if shape[2] % KEPT_TYPES[q].block == 0]


@pytest.mark.parametrize("qtype,rows,n,k", CASES)
def test_quant_gemv_equals_dequantize_then_matmul(qtype, rows, n, k):
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    blocks, ref = _case(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    want = F.linear(x, ref, bias)
    got = quant_gemv(x, blocks, qtype, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    if DEV != "cpu":
        xb = x.bfloat16()
        got = quant_gemv(xb, blocks, qtype).float()
        want = F.linear(xb.float(), ref)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


# planar rows (K types): odd row counts (a partly idle block of rows), a row of 1280 (groups not
# a whole number of a chunk's), the residual, bias and norm options
PLANAR_CASES = [(q, *shape) for q in PLANAR_TYPES
                for shape in [(1, 37, 512), (3, 64, 768), (16, 5, 256), (2, 9, 1280)]]


@pytest.mark.parametrize("qtype,rows,n,k", PLANAR_CASES)
def test_planar_gemv_equals_dequantize_then_matmul(qtype, rows, n, k):
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    blocks, ref = _case(qtype, n, k, seed=rows)
    flat = to_planar(blocks, qtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    want = F.linear(x, ref, bias)
    got = quant_gemv(x, flat, qtype, bias, planar=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    for cfg in ({"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 2},
                {"BLOCK_N": 32, "BLOCK_K": 1024, "num_warps": 4}):
        got = quant_gemv(x, flat, qtype, bias, planar=True, cfg=cfg)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    if DEV != "cpu":
        xb = x.bfloat16()
        got = quant_gemv(xb, flat, qtype, planar=True).float()
        want = F.linear(xb.float(), ref)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


# full-size layers (the Llama-8B shape's qkv, down and gate/up) on a device; under the
# interpreter a small one of each route
FULL = [(6144, 4096), (4096, 14336), (2 * 14336, 4096)] if DEV != "cpu" else [(2 * 24, 512)]


@pytest.mark.parametrize("n,k", FULL)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_planar_gemv_of_full_size_layers_equals_dequantize_then_matmul(qtype, n, k):
    """The planar GEMV at its launch shapes (`planar_launch_config`) and at a chunk of the
    sweep's widest and narrowest, 1 and 4 rows, plain and as the fused step's gate/up (the norm
    prologue, SiLU * up), against the weight dequantized (`quant_blocks.dequantize_rows`,
    gguf's values bit for bit) then a float32 matmul."""
    from layersplit.shards.fused import rms_norm
    from layersplit.shards.kernels.quant_gemv import quant_gemv
    from layersplit.shards.quant_blocks import dequantize_rows

    blocks = torch.from_numpy(random_blocks(n, k, qtype, np.random.default_rng(n + k))).to(DEV)
    ref = dequantize_rows(blocks, qtype)
    flat = to_planar(blocks, qtype)
    gen = torch.Generator().manual_seed(k)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEV)
    for rows in (1, 4):
        x = torch.randn(rows, k, generator=gen).to(DEV)
        want = F.linear(x, ref)
        for cfg in (None, {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 2},
                    {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8}):
            got = quant_gemv(x, flat, qtype, planar=True, cfg=cfg)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        g, u = F.linear(rms_norm(x, nw, 1e-5), ref).chunk(2, dim=-1)
        want = F.silu(g) * u
        got = quant_gemv(x, flat, qtype, norm=(nw, 1e-5), gate_up=True, planar=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", PLANAR_TYPES)
def test_planar_gemv_fused_options_equal_torch(qtype):
    """The norm prologue, SiLU * up and residual epilogues over planar rows (float32), on rows
    3.. of a matrix (planar rows start at multiples of 16 bytes: any row may start a slice)."""
    blocks, ref = _case(qtype, 2 * 24 + 3, 512, seed=4)
    _assert_fused_options(to_planar(blocks, qtype)[3:], ref[3:], qtype, planar=True)


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_gemv_on_rows_of_a_larger_matrix_and_other_launch_shapes(qtype):
    """Rows 3.. of a matrix (blocks that start past its first byte, at an address a 16-byte
    load may not assume), and super blocks an iteration (`SB`) other than the default."""
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    k = 96 if KEPT_TYPES[qtype].block == 32 else 768
    blocks, ref = _case(qtype, 11, k, seed=3)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = F.linear(x, ref[3:])
    for cfg in (None, {"BLOCK_N": 8, "num_warps": 4, "SB": 1},
                {"BLOCK_N": 2, "num_warps": 2, "SB": 2}):
        got = quant_gemv(x, blocks[3:], qtype, cfg=cfg)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_quant_gemv_refuses_bad_blocks():
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    blocks, _ = _case("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="Q6_K blocks of rows of 256"):
        quant_gemv(torch.zeros(1, 256, device=DEV), blocks, "Q6_K")
    with pytest.raises(ValueError, match="1 to 16 rows"):
        quant_gemv(torch.zeros(17, 256, device=DEV), blocks, "Q4_K")
    flat = torch.zeros(4 * 144 + 2, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):  # (its scales are words)
        quant_gemv(torch.zeros(1, 256, device=DEV), flat[2:].view(4, 144), "Q4_K")


@pytest.mark.skipif(DEV == "cpu", reason="minutes under the interpreter: a device run's test")
@pytest.mark.parametrize("fuse", [False, True])
def test_model_on_device_quantized_equals_dequantized(tmp_path, fuse):
    """A tiny Q4_K_M-like model (Q4_K, Q6_K v and head) on the device: the kernels' logits
    (decode steps: the GEMV; the prefill: tiles dequantized by the kernel; `fuse`: the fused
    decode step of a GPU shard, its norms and residual adds folded into the quantized GEMV)
    against the same file dequantized at load, float32, split differently."""
    from tests.shards.test_quant_linear import _logits, write_quant_gguf

    path = write_quant_gguf(tmp_path / "m.gguf", "Q4_K", tied=False)
    want = _logits(path, "dequantize", [(0, 3)], DEV)
    got = _logits(path, "quantized", [(0, 1), (1, 3)], DEV, fuse=fuse)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_fused_gemv_options_equal_torch():
    """The norm prologue, residual and SiLU * up epilogues of the quantized GEMV against the
    torch ops they replace (float32)."""
    blocks, ref = _case("Q4_K", 2 * 24, 512)
    _assert_fused_options(blocks, ref, "Q4_K")


def _assert_fused_options(rows: torch.Tensor, ref: torch.Tensor, qtype: str, **layout) -> None:
    """`quant_gemv` over `rows` (48 weight rows of 512 columns, `ref` their values) with the
    norm prologue and SiLU * up, then with a residual on the first 24, against torch."""
    from layersplit.shards.fused import rms_norm
    from layersplit.shards.kernels.quant_gemv import quant_gemv

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 512, generator=gen).to(DEV)
    nw = (1 + 0.1 * torch.randn(512, generator=gen)).to(DEV)
    res = torch.randn(2, 24, generator=gen).to(DEV)
    xn = rms_norm(x, nw, 1e-5)
    g, u = F.linear(xn, ref).chunk(2, dim=-1)
    want = F.silu(g) * u
    got = quant_gemv(x, rows, qtype, norm=(nw, 1e-5), gate_up=True, **layout)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    want = res + F.linear(x, ref[:24])
    got = quant_gemv(x, rows[:24], qtype, residual=res, **layout)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_module_gemv_of_planar_gate_up_equals_the_silu_epilogue(qtype):
    """The fused step's gate/up over planar rows (`module_gemv`: the GEMV, then SiLU * up as a
    kernel of its own, `PLANAR_SILU_APART`) equals the GEMV with the SiLU epilogue, bit for bit
    (the same roundings), with the norm prologue and without; a bias is refused, as the
    epilogue refuses it."""
    from layersplit.shards.kernels.quant_gemv import quant_gemv
    from layersplit.shards.layers import quant_linear
    from layersplit.shards.layers.quant_linear import QuantLinear, module_gemv

    assert quant_linear.PLANAR_SILU_APART
    blocks, _ = _case(qtype, 2 * 40, 512, seed=11)
    flat = to_planar(blocks, qtype)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 512, generator=gen).to(DEV)
    nw = (1 + 0.1 * torch.randn(512, generator=gen)).to(DEV)
    mod = QuantLinear(flat, qtype, 512, planar=True)
    dtypes = [torch.float32] + [torch.bfloat16] * (DEV != "cpu")  # (the roundings that differ)
    for dt in dtypes:
        for norm in (None, (nw.to(dt), 1e-5)):
            want = quant_gemv(x.to(dt), flat, qtype, norm=norm, gate_up=True, planar=True)
            got = module_gemv(x.to(dt), mod, norm=norm, gate_up=True)
            assert got.shape == (2, 40) and got.dtype == dt
            assert torch.equal(got, want)
    biased = QuantLinear(flat, qtype, 512, torch.zeros(80, device=DEV), planar=True)
    with pytest.raises(ValueError, match="no bias"):  # (refused, not dropped)
        module_gemv(x, biased, gate_up=True)


def test_module_gemv_of_mixed_type_qkv_equals_its_parts():
    """q and k in Q4_K beside v in Q6_K (a Q4_K_M layer's): fused into two GEMVs (q and k's
    rows one `QuantLinear`), each into its columns, with the norm prologue, as the parts'."""
    from layersplit.shards.kernels.quant_gemv import quant_gemv
    from layersplit.shards.layers.fused_linear import concat_linears
    from layersplit.shards.layers.quant_linear import ConcatLinear, QuantLinear, module_gemv

    k = 512
    parts = [QuantLinear(to_planar(_case(t, n, k, seed=n)[0], t), t, k, planar=True)
             for t, n in (("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16))]
    fused = concat_linears(*parts)
    assert isinstance(fused, ConcatLinear) and len(fused.parts) == 2
    assert fused.parts[0].out_features == 48
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(1, k, generator=gen).to(DEV)
    norm = ((1 + 0.1 * torch.randn(k, generator=gen)).to(DEV), 1e-5)
    want = torch.cat([quant_gemv(x, p.blocks, p.qtype, norm=norm, planar=True) for p in parts],
                     dim=-1)
    assert torch.equal(module_gemv(x, fused, norm=norm), want)


def test_expert_gemv_and_module_equal_reference(monkeypatch):
    """The grouped GEMV over chosen experts (`experts=`): gate/up with SiLU * up, then down,
    each row by its own expert, against dequantize-then-matmul row by row; and `QuantExperts`
    on the kernels against its dequantizing loop (float32)."""
    from layersplit.shards.kernels.quant_gemv import quant_gemv
    from layersplit.shards.layers.quant_experts import QuantExperts

    e, i, h, rows = 4, 256, 256, 6
    gate_up, gu_ref = _case("Q4_K", e * 2 * i, h, seed=7)
    down, d_ref = _case("Q6_K", e * h, i, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, h, generator=gen).to(DEV)
    ids = torch.tensor([3, 0, 3, 1, 2, 0], device=DEV)
    act = quant_gemv(x, gate_up, "Q4_K", gate_up=True, experts=(ids, 2 * i))
    y = quant_gemv(act, down, "Q6_K", experts=(ids, h))
    for r in range(rows):
        wgu = gu_ref[ids[r] * 2 * i:(ids[r] + 1) * 2 * i]
        g, u = F.linear(x[r], wgu[:i]), F.linear(x[r], wgu[i:])
        want_act = F.silu(g) * u
        torch.testing.assert_close(act[r], want_act, rtol=0,
                                   atol=1e-5 * want_act.abs().max().item())
        want = F.linear(act[r], d_ref[ids[r] * h:(ids[r] + 1) * h])
        torch.testing.assert_close(y[r], want, rtol=0, atol=1e-5 * want.abs().max().item())
    gate = gate_up.view(e, 2 * i, -1)[:, :i].reshape(e * i, -1)
    up = gate_up.view(e, 2 * i, -1)[:, i:].reshape(e * i, -1)
    mod = QuantExperts(gate, up, down, ("Q4_K", "Q4_K", "Q6_K"), e, h, i)
    w = torch.rand(3, 2, generator=gen).to(DEV)
    idx = ids.view(3, 2)
    got = mod(x[:3], w, idx)  # (the kernels: 6 pairs)
    monkeypatch.setattr("layersplit.shards.kernels.quant_gemv.EXPERT_ROWS", 2)
    torch.testing.assert_close(mod(x[:3], w, idx), got, rtol=0, atol=0)  # a launch a token
    mod.kernels = False
    want = mod(x[:3], w, idx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
