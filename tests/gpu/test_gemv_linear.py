"""The projections of layers off the fused step (`shards.layers.gemv_linear`): a one-row step
through the GEMV kernel against `F.linear`, a fused gate/up's SiLU(g) * u against the torch ops,
an MLP switched by `linears_as_gemv` against the same MLP as it was, and more rows than the
GEMV takes staying on `F.linear`.

On a CUDA device (`python -m pytest -m gpu`), at a DeepSeek-V2-Lite projection's width; on a CPU
through Triton's interpreter (`TRITON_INTERPRET=1`, float32, small shapes).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.layers.gemv_linear import GemvLinear, linears_as_gemv
from layersplit.shards.layers.mlp import MLP

from tests.gpu import KERNEL_DEV, KERNEL_DTYPES, kernel_marks, near

pytestmark = kernel_marks()
CUDA = KERNEL_DEV != "cpu"
H, F_OUT = (2048, 3648) if CUDA else (64, 96)  # (DeepSeek-V2-Lite: q and latent projections)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _linear(dtype: torch.dtype, bias: bool) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(H, F_OUT, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(F_OUT, H, generator=g) * H ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(F_OUT, generator=g))
    return lin.to(KERNEL_DEV, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_takes_the_kernel_and_equals_linear(dtype, bias):
    lin = _linear(dtype, bias)
    want_mod = copy.deepcopy(lin)
    assert linears_as_gemv(lin) == 1 and type(lin) is GemvLinear
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEV, dtype)
    assert lin.takes(x)
    got, want = lin(x), F.linear(x, want_mod.weight, want_mod.bias)
    assert got.dtype == dtype and got.shape == want.shape
    assert near(got, want, TOL[dtype])
    assert set(dict(lin.named_parameters())) == set(dict(want_mod.named_parameters()))


def test_more_rows_than_the_gemv_takes_run_linear(monkeypatch):
    lin = _linear(torch.float32, True)
    linears_as_gemv(lin)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2)).to(KERNEL_DEV)
    assert not lin.takes(x)  # (the GEMV takes one row unless LAYERSPLIT_GEMV_ROWS says more)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    monkeypatch.setenv("LAYERSPLIT_GEMV_ROWS", "8")
    assert lin.takes(x) and near(lin(x), F.linear(x, lin.weight, lin.bias), 1e-5)


def _mlps(dtype: torch.dtype, seed: int) -> tuple[MLP, MLP]:
    """(an MLP in the GPU layout switched by `linears_as_gemv`, a copy of it as it was)."""
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=2 * H, hidden_act="silu")
    torch.manual_seed(seed)
    mlp = MLP(cfg)
    for p in mlp.parameters():
        p.data.normal_(0.0, H ** -0.5)
    mlp = mlp.to(KERNEL_DEV, dtype)
    mlp.fuse()
    want_mlp = copy.deepcopy(mlp)
    assert linears_as_gemv(mlp) == 2
    return mlp, want_mlp


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_switched_mlp_equals_the_torch_mlp(dtype):
    mlp, want_mlp = _mlps(dtype, 3)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEV, dtype)
    assert mlp.gate_up_proj.silu_gate_up(x) is not None
    got, want = mlp(x), want_mlp(x)
    assert near(got, want, TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_residual_add_in_the_gemv_equals_the_torch_add(dtype):
    """A shared expert's down projection plus the routed experts' sum (`MLP(x, residual=r)`)
    in the GEMV's launch, against the projection and then the add."""
    mlp, want_mlp = _mlps(dtype, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, H, generator=g).to(KERNEL_DEV, dtype)
    r = torch.randn(1, H, generator=g).to(KERNEL_DEV, dtype)
    want = want_mlp(x, residual=r)
    assert torch.equal(want, r + want_mlp(x))
    assert near(mlp(x, residual=r), want, TOL[dtype])
    lin = mlp.down_proj
    h = torch.randn(1, lin.in_features, generator=g).to(KERNEL_DEV, dtype)
    assert near(lin.add_to(r, h), r + F.linear(h, lin.weight), TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_input_norm_in_the_gemv_equals_the_norm_then_the_projection(dtype, bias):
    """A layer's input RMSNorm as the GEMV's prologue (`GemvLinear.normed`: latent attention's
    fused input projection) against the norm and then the projection; a norm whose rounding
    the prologue does not follow (`FloatProductRMSNorm`) runs apart, as does a step of more
    rows than the GEMV takes."""
    from layersplit.shards.layers.norm import FloatProductRMSNorm, RMSNorm

    lin = _linear(dtype, bias)
    linears_as_gemv(lin)
    g = torch.Generator().manual_seed(7)
    norm = RMSNorm(H, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(H, generator=g)
    norm = norm.to(KERNEL_DEV, dtype)
    x = (torch.randn(1, H, generator=g) * 3).to(KERNEL_DEV, dtype)
    want = F.linear(norm(x), lin.weight, lin.bias)
    assert near(lin.normed(x, norm), want, TOL[dtype])
    other = FloatProductRMSNorm(H, 1e-6).to(KERNEL_DEV, dtype)
    other.weight.data.copy_(norm.weight)
    assert torch.equal(lin.normed(x, other), lin(other(x)))
    rows = x.repeat(80, 1)  # (past the GEMV's rows: F.linear)
    assert torch.equal(lin.normed(rows, norm), F.linear(norm(rows), lin.weight, lin.bias))
