"""The row kernels between a dense layer's GEMMs (`shards.kernels.row_ops`) against the eager
torch functions they replace (`shards.fused.rms_norm`, the float32 residual add, F.silu(g) * u).

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: float32 within 1e-5 relative; bf16: the residual
sum equals torch's bit for bit (one rounding of the same float32 sum), the norm and SiLU * up
within one bf16 ulp (the float32 sum of squares is reduced in another order, and `tl.exp`,
`rsqrt` are not torch's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.fused import rms_norm
from layersplit.shards.kernels import fused_kernels_available

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 64), (1, 576), (3, 1000), (8, 4096), (2, 12288)])
def test_add_rms_norm_matches_torch(rows, width, dtype):
    from layersplit.shards.kernels.row_ops import add_rms_norm, rms_norm_rows

    g = torch.Generator().manual_seed(rows * width)
    h = (torch.randn(rows, width, generator=g) * 3).to(DEV, dtype)
    x = torch.randn(rows, width, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(DEV, dtype)
    total, normed = add_rms_norm(h, x, w, 1e-6)
    want_total = (h.float() + x.float()).to(dtype)
    assert torch.equal(total, want_total)
    _close(normed, rms_norm(want_total, w, 1e-6), dtype)
    _close(rms_norm_rows(h, w, 1e-5), rms_norm(h, w, 1e-5), dtype)
    only_sum, none = add_rms_norm(h, x, None, 0.0)
    assert none is None and torch.equal(only_sum, want_total)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_reads_strided_rows(dtype):
    """Rows of a wider buffer (a stride past the width) are read and the outputs are dense."""
    from layersplit.shards.kernels.row_ops import add_rms_norm

    base = torch.randn(4, 700, device=DEV).to(dtype)
    h, x = base[:, :576], base[:, 100:676]
    w = torch.rand(576, device=DEV).to(dtype)
    total, normed = add_rms_norm(h, x, w, 1e-5)
    want_total = (h.float() + x.float()).to(dtype)
    assert torch.equal(total, want_total) and total.is_contiguous()
    _close(normed, rms_norm(want_total, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 1000), (1, 12288), (0, 64)])
def test_silu_mul_matches_torch(rows, width, dtype):
    from layersplit.shards.kernels.row_ops import silu_mul

    g = torch.Generator().manual_seed(width + rows)
    gu = (torch.randn(rows, 2 * width, generator=g) * 4).to(DEV, dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_stages_rounding(dtype):
    """`float_sum` (the norm of the float32 sum), `x2` (h + x + x2 summed in float32, rounded
    once) and `round_act=False` (SiLU * up rounded once): as inductor computes a compiled
    stage, `hybrid_row_ops`. In bfloat16 each is nearer the float64 result than the eager
    rounding it replaces, and differs from it."""
    from layersplit.shards.kernels.row_ops import add_rms_norm, silu_mul

    g = torch.Generator().manual_seed(7)
    h, x, y = ((torch.randn(8, 4096, generator=g) * 3).to(DEV, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(4096, generator=g)).to(DEV, torch.float32)
    s32, s64 = h.float() + x.float(), h.double() + x.double()
    total, normed = add_rms_norm(h, x, w, 1e-6, float_product=True, float_sum=True)
    assert torch.equal(total, s32.to(dtype))  # (the sum stored as torch's add rounds it)
    want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    eager = add_rms_norm(h, x, w, 1e-6, float_product=True)[1]
    three, none = add_rms_norm(h, x, None, 0.0, x2=y)
    assert none is None and torch.equal(three, (s32 + y.float()).to(dtype))
    gu = torch.cat([h, x], dim=-1)
    act64 = F.silu(h.double()) * x.double()
    act, act_eager = silu_mul(gu, round_act=False), silu_mul(gu)
    if dtype == torch.float32:  # (no rounding to tell apart: equal to float32's)
        _close(normed, want.float(), dtype)
        _close(act, act64.float(), dtype)
    else:
        def err(t, ref):
            return (t.double() - ref).abs().mean().item()

        assert not torch.equal(normed, eager) and err(normed, want) < err(eager, want)
        assert not torch.equal(act, act_eager) and err(act, act64) < err(act_eager, act64)
    with pytest.raises(ValueError, match="x2"):
        add_rms_norm(h, None, None, 0.0, x2=y)


def test_bad_shapes_are_refused_by_name():
    from layersplit.shards.kernels.row_ops import add_rms_norm, silu_mul

    h = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="does not match h"):
        add_rms_norm(h, torch.zeros(2, 4, device=DEV), None, 0.0)
    with pytest.raises(ValueError, match="norm weight"):
        add_rms_norm(h, h, torch.zeros(4, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="gate/up width 7 is odd"):
        silu_mul(torch.zeros(1, 7, device=DEV))
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_mul(torch.zeros(8, 2, device=DEV).t())
