"""The hybrid one-row step's elementwise kernels (`shards.kernels.hybrid_row_ops`) against the
torch functions they replace (`shards.fused_hybrid`'s `linear_conv`, `linear_gate`,
`attn_pre`, `gate_output`), on the Qwen3.5-27B shape's widths on a CUDA device (bfloat16 and
float32), on small widths through Triton's interpreter on a CPU (float32).

On a CUDA device (`python -m pytest -m gpu`); on a CPU through `TRITON_INTERPRET=1`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards import fused_hybrid

from tests.gpu import KERNEL_DEV, KERNEL_DTYPES, kernel_marks, near

pytestmark = kernel_marks()
CUDA = KERNEL_DEV != "cpu"
# (heads and widths: Qwen3.5-27B's linear layers 16 key heads x 48 value heads of 128, its
# attention 24 query heads and 4 key heads of 256, a quarter of it rotated)
HK, HV, DK, DV = (16, 48, 128, 128) if CUDA else (2, 4, 16, 8)
NH, NG, HD, ROT = (24, 4, 256, 64) if CUDA else (4, 2, 32, 8)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=KERNEL_DEV) * scale).to(dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_conv_and_gates_equal_linear_conv(dtype, rows):

    gen = torch.Generator(device=KERNEL_DEV).manual_seed(1)
    kd, vd = HK * DK, HV * DV
    c = 2 * kd + vd
    p = _rand(rows, c + vd + 2 * HV + 5, dtype=dtype, gen=gen)[:, 5:]  # (a row stride of its own)
    conv_w = _rand(c, 4, dtype=dtype, gen=gen, scale=0.5)
    pool = _rand(rows + 2, c, 3, dtype=dtype, gen=gen)
    state = pool[1:rows + 1]  # (a slice of a pool, as a slot's)
    a_log = _rand(HV, dtype=dtype, gen=gen, scale=0.5)
    dt_bias = _rand(HV, dtype=dtype, gen=gen)
    want = fused_hybrid.linear_conv(p, conv_w, state, a_log, dt_bias, c, kd, vd, HK, HV, DK, DV)
    got = fused_hybrid.row_kernel_conv(p, conv_w, state, a_log, dt_bias, c, kd, vd, HK, HV, DK,
                                       DV)
    for name, w, g in zip(("q", "k", "v", "g", "beta", "z", "new conv"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert near(g, w, _tol(dtype)), name
    assert torch.equal(got[-1], want[-1])  # (the state's shift: values moved, not computed)
    assert torch.equal(pool[1:rows + 1], state)  # (the pool's states left as they were)


def test_conv_refuses_a_state_of_another_shape():
    from layersplit.shards.kernels.hybrid_row_ops import conv_gates

    p = torch.zeros(1, 2 * 8 + 8 + 4, device=KERNEL_DEV)
    with pytest.raises(ValueError, match="conv of 24 channels"):
        conv_gates(p, torch.zeros(24, 4, device=KERNEL_DEV), torch.zeros(1, 24, 2,
                   device=KERNEL_DEV), torch.zeros(2, device=KERNEL_DEV),
                   torch.zeros(2, device=KERNEL_DEV), 24, 8, 2)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gated_norm_equals_linear_gate(dtype):
    gen = torch.Generator(device=KERNEL_DEV).manual_seed(2)
    rows = 2
    o = _rand(rows, 1, HV, DV, dtype=dtype, gen=gen, scale=3.0)
    p = _rand(rows, HV * DV + 7, dtype=dtype, gen=gen)  # (z a view with a row stride)
    z = p[:, 7:].reshape(rows, 1, HV, DV)
    w = _rand(DV, dtype=dtype, gen=gen)
    want = fused_hybrid.linear_gate(o, z, w, 1e-6)
    got = fused_hybrid.row_kernel_gate(o, z, w, 1e-6)
    assert got.shape == want.shape == (rows, HV * DV) and got.dtype == want.dtype
    assert near(got, want, _tol(dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_attention_norms_rotary_and_gate_equal_attn_pre(dtype, bias):
    """`row_kernel_attn_pre` (the input norm, the projection, then `zc_rope_qk`) and the output
    gate read in place (`row_kernel_output_gate`) against `attn_pre` and `gate_output`."""
    gen = torch.Generator(device=KERNEL_DEV).manual_seed(3)
    hidden, rows = (5120, 1) if CUDA else (48, 2)
    h = _rand(rows, hidden, dtype=dtype, gen=gen, scale=2.0)
    ln_w = _rand(hidden, dtype=dtype, gen=gen, scale=0.2)
    qkv_w = _rand(2 * NH * HD + 2 * NG * HD, hidden, dtype=dtype, gen=gen,
                  scale=hidden ** -0.5)
    qkv_b = _rand(qkv_w.shape[0], dtype=dtype, gen=gen) if bias else None
    qn, kn = (_rand(HD, dtype=dtype, gen=gen, scale=0.2) for _ in range(2))
    ang = torch.rand(rows, ROT // 2, generator=gen, device=KERNEL_DEV) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(dtype)

    qk32 = tuple((1.0 + t.float()).contiguous() for t in (qn, kn))
    ln32 = (1.0 + ln_w.float()).contiguous()
    want = fused_hybrid.attn_pre(h, ln_w, qkv_w, qkv_b, qn, kn, cos, sin, 1e-6, NH, NG, HD)
    got = fused_hybrid.row_kernel_attn_pre(h, ln32, qkv_w, qkv_b, qk32, cos, sin, 1e-6, NH, NG,
                                           HD)
    for name, w, g in zip("qkv", want[:3], got[:3]):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert near(g, w, _tol(dtype)), name
    attn = _rand(rows, NH * HD, dtype=dtype, gen=gen)
    want_gated = fused_hybrid.gate_output(attn, want[3])
    got_gated = fused_hybrid.row_kernel_output_gate(attn, got[3])
    assert got_gated.shape == want_gated.shape and near(got_gated, want_gated, _tol(dtype))


def test_the_input_norm_is_zc_norm_bit_for_bit():
    """`row_kernel_norm` (`rms_norm_rows` with the float32 1 + w) rounds once, as `zc_norm`."""
    gen = torch.Generator(device=KERNEL_DEV).manual_seed(4)
    dtype = KERNEL_DTYPES[-1]
    h = _rand(2, 5120 if CUDA else 64, dtype=dtype, gen=gen, scale=3.0)
    w = _rand(h.shape[1], dtype=dtype, gen=gen, scale=0.2)
    want = fused_hybrid.zc_norm(h, w, 1e-6)
    got = fused_hybrid.row_kernel_norm(h, (1.0 + w.float()).contiguous(), 1e-6)
    assert near(got, want, _tol(dtype))
    assert F.mse_loss(got.float(), want.float()) < 1e-6


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("dense", [True, False])
def test_the_batched_stages_equal_the_torch_stages(dtype, dense):
    """`row_linear_pre`, `row_linear_post` and `row_attn_post` (a batched step's stages through
    the row kernels) against `linear_pre`, `linear_post` and `attn_post`; `dense` False: a
    sparse MLP's layer (the stage ends after the mixer's residual add)."""
    gen = torch.Generator(device=KERNEL_DEV).manual_seed(5)
    hidden, inter, rows = (5120, 17408, 4) if CUDA else (48, 40, 3)
    kd, vd = HK * DK, HV * DV
    c = 2 * kd + vd
    h = _rand(rows, hidden, dtype=dtype, gen=gen, scale=2.0)
    ln_w, ln2_w = (_rand(hidden, dtype=dtype, gen=gen, scale=0.2) for _ in range(2))
    ln32, ln2_32 = ((1.0 + w.float()).contiguous() for w in (ln_w, ln2_w))
    in_w = _rand(c + vd + 2 * HV, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    conv_w = _rand(c, 4, dtype=dtype, gen=gen, scale=0.5)
    state = _rand(rows, c, 3, dtype=dtype, gen=gen)
    a_log, dt_bias = (_rand(HV, dtype=dtype, gen=gen, scale=0.5) for _ in range(2))
    args = (conv_w, state, a_log, dt_bias, 1e-6, c, kd, vd, HK, HV, DK, DV)
    want = fused_hybrid.linear_pre(h, ln_w, in_w, *args)
    got = fused_hybrid.row_linear_pre(h, ln32, in_w, *args)
    for name, w, g in zip(("q", "k", "v", "g", "beta", "z", "new conv"), want, got):
        assert g.shape == w.shape and near(g, w, _tol(dtype)), name
    o = _rand(rows, 1, HV, DV, dtype=dtype, gen=gen)
    z = want[5]
    norm_w = _rand(DV, dtype=dtype, gen=gen)
    out_w = _rand(hidden, vd, dtype=dtype, gen=gen, scale=vd ** -0.5)
    gu_w = _rand(2 * inter, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5) if dense else None
    down_w = _rand(hidden, inter, dtype=dtype, gen=gen, scale=inter ** -0.5) if dense else None
    want = fused_hybrid.linear_post(h, o, z, norm_w, 1e-6, out_w, ln2_w, gu_w, down_w, 1e-6)
    got = fused_hybrid.row_linear_post(h, o, z, norm_w, 1e-6, out_w, ln2_32, gu_w, down_w, 1e-6)
    assert got.shape == want.shape and near(got, want, _tol(dtype))
    attn = _rand(rows, NH * HD, dtype=dtype, gen=gen)
    qkv = _rand(rows, 2 * NH * HD + 2 * NG * HD, dtype=dtype, gen=gen)
    gate = qkv[:, :2 * NH * HD].view(rows, NH, 2 * HD)[:, :, HD:].reshape(rows, NH * HD)
    o_w = _rand(hidden, NH * HD, dtype=dtype, gen=gen, scale=(NH * HD) ** -0.5)
    want = fused_hybrid.attn_post(h, attn, gate, o_w, ln2_w, gu_w, down_w, 1e-6)
    got = fused_hybrid.row_attn_post(h, attn, (qkv, NH, HD), o_w, ln2_32, gu_w, down_w, 1e-6)
    assert got.shape == want.shape and near(got, want, _tol(dtype))


def test_shapes_the_kernels_do_not_take_are_refused_by_name():
    """A gated norm over several rows of one sequence, q/k norm scales not in float32, an
    attention output of another width: a ValueError naming what differs, nothing launched."""
    from layersplit.shards.kernels.hybrid_row_ops import gated_norm, sigmoid_gate, zc_rope_qk

    o = torch.zeros(1, 2, HV, DV, device=KERNEL_DEV)
    with pytest.raises(ValueError, match="gated_norm"):
        gated_norm(o, o, torch.ones(DV, device=KERNEL_DEV), 1e-6)
    qkv = torch.zeros(1, 2 * NH * HD + 2 * NG * HD, device=KERNEL_DEV)
    cos = torch.zeros(1, ROT, device=KERNEL_DEV)
    half = torch.ones(HD, dtype=torch.float16, device=KERNEL_DEV)
    with pytest.raises(ValueError, match="float32 weights"):
        zc_rope_qk(qkv, cos, cos, half, half, 1e-6, NH, NG, HD)
    with pytest.raises(ValueError, match="sigmoid_gate"):
        sigmoid_gate(torch.zeros(1, NH * HD - 1, device=KERNEL_DEV), qkv, NH, HD)



def _rounding_error(stage, got, *args) -> tuple[float, float]:
    """The mean distance of `got` and of `stage` compiled by torch.compile, run on `args`
    (bfloat16), from `stage` run on the same inputs in float64 (its norms and SiLU in float32,
    where it casts there: far finer than bfloat16's rounding either way)."""
    ideal = stage(*(a.double() if torch.is_tensor(a) else a for a in args))
    want = torch.compile(stage, dynamic=False)(*args)
    if torch.is_tensor(ideal):
        got, want, ideal = (got,), (want,), (ideal,)
    err = [sum((x.double() - i).abs().mean().item() for x, i in zip(out, ideal))
           for out in (got, want)]
    return err[0], err[1]


@pytest.mark.skipif(not CUDA, reason="bfloat16 rounding; the interpreter runs float32 here")
def test_the_kernels_round_no_worse_than_the_compiled_stages():
    """bfloat16 on the Qwen3.5-27B shape: each row kernel's output is as near the stage it
    replaces run in float64 as that stage compiled by torch.compile is (the kernels keep
    float32 between ops and round where the stage casts or stores; rounded after each op as
    eager torch rounds, they answered worse in bench/parity.py)."""
    gen = torch.Generator(device=KERNEL_DEV).manual_seed(6)
    dtype, hidden, inter = torch.bfloat16, 5120, 17408
    kd, vd = HK * DK, HV * DV
    c = 2 * kd + vd
    p = _rand(1, c + vd + 2 * HV, dtype=dtype, gen=gen)
    conv_w = _rand(c, 4, dtype=dtype, gen=gen, scale=0.5)
    state = _rand(1, c, 3, dtype=dtype, gen=gen)
    a_log, dt_bias = (_rand(HV, dtype=dtype, gen=gen, scale=0.5) for _ in range(2))
    args = (p, conv_w, state, a_log, dt_bias, c, kd, vd, HK, HV, DK, DV)
    got = fused_hybrid.row_kernel_conv(*args)[:3]  # (q, k, v: the conv's SiLU)

    def conv_silu(*args):
        return fused_hybrid.linear_conv(*args)[:3]

    mine, compiled = _rounding_error(conv_silu, got, *args)
    assert mine <= 1.02 * compiled, ("conv", mine, compiled)

    o = _rand(1, 1, HV, DV, dtype=dtype, gen=gen, scale=3.0)
    z = _rand(1, 1, HV, DV, dtype=dtype, gen=gen)
    norm_w = _rand(DV, dtype=dtype, gen=gen)
    got = fused_hybrid.row_kernel_gate(o, z, norm_w, 1e-6)
    mine, compiled = _rounding_error(fused_hybrid.linear_gate, got, o, z, norm_w, 1e-6)
    assert mine <= 1.02 * compiled, ("gated norm", mine, compiled)

    qkv = _rand(1, 2 * NH * HD + 2 * NG * HD, dtype=dtype, gen=gen, scale=2.0)
    qn, kn = (_rand(HD, dtype=dtype, gen=gen, scale=0.2) for _ in range(2))
    ang = torch.rand(1, ROT // 2, generator=gen, device=KERNEL_DEV) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(dtype)

    def norms_rotary(qkv, qn, kn, cos, sin):  # (`attn_pre` after its projection)
        q = qkv[:, :2 * NH * HD].view(1, NH, 2 * HD)[:, :, :HD]
        k = qkv[:, 2 * NH * HD:2 * NH * HD + NG * HD].view(1, NG, HD)
        return (fused_hybrid.apply_partial_rope(fused_hybrid.zc_norm(q, qn, 1e-6), cos, sin),
                fused_hybrid.apply_partial_rope(fused_hybrid.zc_norm(k, kn, 1e-6), cos, sin))

    from layersplit.shards.kernels.hybrid_row_ops import zc_rope_qk

    got = zc_rope_qk(qkv, cos, sin, (1.0 + qn.float()).contiguous(),
                     (1.0 + kn.float()).contiguous(), 1e-6, NH, NG, HD)
    mine, compiled = _rounding_error(norms_rotary, got, qkv, qn, kn, cos, sin)
    assert mine <= 1.02 * compiled, ("q/k norms and rotary", mine, compiled)

    attn = _rand(1, NH * HD, dtype=dtype, gen=gen)
    out_gate = qkv[:, :2 * NH * HD].view(1, NH, 2 * HD)[:, :, HD:].reshape(1, NH * HD)
    got = fused_hybrid.row_kernel_output_gate(attn, (qkv, NH, HD))
    mine, compiled = _rounding_error(fused_hybrid.gate_output, got, attn, out_gate)
    assert mine <= 1.02 * compiled, ("output gate", mine, compiled)

    h = _rand(4, hidden, dtype=dtype, gen=gen, scale=2.0)
    x = _rand(4, hidden, dtype=dtype, gen=gen)
    ln2_w = _rand(hidden, dtype=dtype, gen=gen, scale=0.2)
    gu_w = _rand(2 * inter, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    down_w = _rand(hidden, inter, dtype=dtype, gen=gen, scale=inter ** -0.5)

    def mlp(h, x, ln2_w, gu_w, down_w):  # (`linear_post` after out_proj)
        return fused_hybrid._mlp(fused_hybrid.residual(h, x), ln2_w, gu_w, down_w, 1e-6)

    got = fused_hybrid.row_kernel_mlp(h, x, (1.0 + ln2_w.float()).contiguous(), gu_w, down_w,
                                      1e-6)
    mine, compiled = _rounding_error(mlp, got, h, x, ln2_w, gu_w, down_w)
    assert mine <= 1.02 * compiled, ("MLP", mine, compiled)
