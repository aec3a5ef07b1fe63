"""The kernels of gpt-oss's, DeepSeek-V3's and GLM-4.5's decode steps against the torch code they
replace: gpt-oss's experts (`moe_gemv.oss_moe_gemv`, against `OssExperts._loop`, transformers'
order), its routing (`moe_route_softmax_top`: the top k logits, then their softmax), DeepSeek-V3's
grouped sigmoid routing (`moe_route_grouped`, against `grouped_moe.route_grouped`'s torch code)
and the row-kernel RMSNorms of the layers that run the torch path (`norm.norms_as_row_kernels`).

On a CUDA device (`python -m pytest -m gpu`), at published shapes; on a CPU through Triton's
interpreter (`TRITON_INTERPRET=1`, float32, small shapes). The dispatch (`few_rows_kernels`)
needs CUDA (`routed_moe.load_gemv`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.layers import grouped_moe, routed_moe
from layersplit.shards.layers.norm import FloatProductRMSNorm, RMSNorm, norms_as_row_kernels
from layersplit.shards.layers.oss_moe import OssExperts, OssMoE
from layersplit.shards.model_config import config_from_hf
from layersplit.shards.tiny import FAMILY_CONFIGS

from tests.gpu import KERNEL_DEV, KERNEL_DTYPES, kernel_marks, near

pytestmark = kernel_marks()
CUDA = KERNEL_DEV != "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="the dispatch loads the kernels on CUDA only")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=KERNEL_DEV).manual_seed(seed)


def _oss_config(e: int, h: int, i: int):
    raw = {**FAMILY_CONFIGS["gpt_oss"], "num_hidden_layers": 4, "vocab_size": 320,
           "num_local_experts": e, "hidden_size": h, "intermediate_size": i,
           "swiglu_limit": 7.0}  # (gpt-oss-20b's)
    return config_from_hf(raw, "config.json")


def _oss_experts(dtype: torch.dtype) -> OssExperts:
    """gpt-oss-20b's expert shape on a GPU (32 experts, 2880 wide); a small one on a CPU."""
    e, h, i = (32, 2880, 2880) if CUDA else (6, 64, 48)
    cfg = _oss_config(e, h, i)
    ex = OssExperts(cfg).to(KERNEL_DEV)
    g = _gen(0)
    with torch.no_grad():
        for p, scale in ((ex.gate_up_proj, h ** -0.5), (ex.down_proj, i ** -0.5),
                         (ex.gate_up_proj_bias, 0.5), (ex.down_proj_bias, 0.5)):
            p.copy_(torch.randn(p.shape, generator=g, device=KERNEL_DEV) * scale * 4)
    ex = ex.to(dtype)
    ex.fuse()
    return ex


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3])
def test_oss_gemv_matches_the_expert_loop(dtype, rows):
    from layersplit.shards.kernels.moe_gemv import moe_route_softmax_top, oss_moe_gemv
    ex = _oss_experts(dtype)
    e, h = ex.down_proj.shape[0], ex.down_proj.shape[2]
    g = _gen(1)
    x = (torch.randn(rows, h, generator=g, device=KERNEL_DEV) * 2).to(dtype)
    logits = torch.randn(rows, e, generator=g, device=KERNEL_DEV).to(dtype)
    w, idx = moe_route_softmax_top(logits, 4)
    w = w.to(dtype)
    # the clamp must bite: some gate/up values past the limit
    gu = torch.einsum("nh,ehf->nef", x.float(), ex.gate_up_proj.float())
    assert (gu.abs() > ex.limit).any()
    ref = ex._loop(x, w, idx)
    got = oss_moe_gemv(x, w, idx, ex.gate_up_proj.transpose(1, 2), ex.gate_up_proj_bias,
                       ex.down_proj.transpose(1, 2), ex.down_proj_bias, ex.alpha, ex.limit)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert near(got, ref, 1e-4 if dtype == torch.float32 else 0.03)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("experts,top_k", [(32, 4), (128, 4), (12, 3)])
def test_softmax_top_route_matches_torch(dtype, experts, top_k):
    from layersplit.shards.kernels.moe_gemv import moe_route_softmax_top
    logits = torch.randn(8, experts, generator=_gen(2), device=KERNEL_DEV).to(dtype)
    w, idx = moe_route_softmax_top(logits, top_k)
    top, idx_ref = torch.topk(logits, top_k, dim=-1)
    # (bf16 logits tie: the picks must have the torch picks' logits, in order)
    assert torch.equal(logits.gather(1, idx), top)
    assert near(w, torch.softmax(top.float(), dim=-1), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if CUDA else []),
                         ids=str)
@pytest.mark.parametrize("norm", [True, False])
def test_route_weights_stored_in_a_dtype_equal_the_float32_weights_rounded(dtype, norm):
    """`moe_route(..., dtype)` (Qwen's weights in the row's dtype, no cast launched) stores each
    weight as the float32 weights' `.to(dtype)` rounds it, with the same experts. (float16 on
    the interpreter: it truncates bf16 conversions.)"""
    from layersplit.shards.kernels.moe_gemv import moe_route

    logits = torch.randn(8, 60, generator=_gen(3), device=KERNEL_DEV) * 3
    w32, ids32 = moe_route(logits, 4, norm)
    w, ids = moe_route(logits, 4, norm, dtype)
    assert w32.dtype == torch.float32 and w.dtype == dtype
    assert torch.equal(ids, ids32) and torch.equal(w, w32.to(dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("experts,top_k,renorm,softmax_top", [
    (128, 8, True, False), (60, 4, False, False), (8, 2, True, False), (32, 4, False, True)])
def test_routing_in_the_routers_gemv_equals_the_gemv_then_the_route(dtype, experts, top_k,
                                                                    renorm, softmax_top):
    """`gemv.gemv_route` (the last of the router GEMV's programs routes the row) against the
    GEMV then `moe_route` / `moe_route_softmax_top` on its logits: the same experts, the same
    weights, the normed row written for the experts; called again on the same counter (a
    graph's replays), which it leaves at zero."""
    from layersplit.shards.kernels.gemv import gemv, gemv_route, route_counter
    from layersplit.shards.kernels.moe_gemv import moe_route, moe_route_softmax_top

    k = 512 if CUDA else 96
    g = _gen(experts)
    counter = route_counter(KERNEL_DEV)
    norm = (torch.rand(k, generator=g, device=KERNEL_DEV).to(dtype) + 0.5, 1e-6)
    router = (torch.randn(experts, k, generator=g, device=KERNEL_DEV) * k ** -0.5).to(dtype)
    for _ in range(3):
        x = (torch.randn(1, k, generator=g, device=KERNEL_DEV) * 2).to(dtype)
        normed, want_normed = torch.empty_like(x), torch.empty_like(x)
        logits = gemv(x, router, norm=norm, norm_out=want_normed)
        want = moe_route_softmax_top(logits, top_k) if softmax_top else \
            moe_route(logits, top_k, renorm, dtype)
        got = gemv_route(x, router, counter, top_k, renorm, norm=norm, norm_out=normed,
                         weights_dtype=None if softmax_top else dtype, softmax_top=softmax_top)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        assert torch.equal(normed, want_normed) and int(counter) == 0


def test_routing_in_the_routers_gemv_refuses_what_it_does_not_take():
    from layersplit.shards.kernels.gemv import gemv_route, route_counter

    x = torch.randn(1, 64, device=KERNEL_DEV)
    w = torch.randn(16, 64, device=KERNEL_DEV)
    counter = route_counter(KERNEL_DEV)
    with pytest.raises(ValueError, match="one row"):
        gemv_route(torch.randn(2, 64, device=KERNEL_DEV), w, counter, 2, True)
    with pytest.raises(ValueError, match="counter"):
        gemv_route(x, w, torch.zeros(1, device=KERNEL_DEV), 2, True)
    with pytest.raises(ValueError, match="top_k=17 of 16"):
        gemv_route(x, w, counter, 17, True)
    with pytest.raises(ValueError, match="norm_out"):
        gemv_route(x, w, counter, 2, True, norm_out=torch.empty_like(x))


def _route_torch(x, router_w, bias, top_k, n_group, topk_group, norm, scaling):
    saved = routed_moe._kernels
    routed_moe._kernels = None  # (the torch code)
    try:
        return grouped_moe.route_grouped(x, router_w, bias, top_k, n_group, topk_group, norm,
                                         scaling)
    finally:
        routed_moe._kernels = saved


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,norm,scaling", [
    (64, 6, 8, 4, True, 2.5),  # the DeepSeek-V2-Lite-width shape's
    (256, 8, 8, 4, True, 2.5),  # DeepSeek-V3's
    (128, 8, 1, 1, True, 1.0),  # GLM-4.5-Air's
    (384, 8, 1, 1, True, 2.827),  # Kimi K2's
    (48, 5, 3, 2, False, 1.0),  # groups and experts not powers of two, no renormalisation
])
def test_grouped_route_matches_torch(experts, top_k, n_group, topk_group, norm, scaling):
    from layersplit.shards.kernels.moe_gemv import moe_route_grouped
    g = _gen(3)
    h = 256 if CUDA else 32
    x = torch.randn(8, h, generator=g, device=KERNEL_DEV)
    router_w = torch.randn(experts, h, generator=g, device=KERNEL_DEV) * h ** -0.5
    bias = torch.randn(experts, generator=g, device=KERNEL_DEV) * 0.3
    w_ref, idx_ref = _route_torch(x, router_w, bias, top_k, n_group, topk_group, norm, scaling)
    w, idx = moe_route_grouped(F.linear(x, router_w), bias, top_k, n_group, topk_group, norm,
                               scaling)
    assert torch.equal(idx, idx_ref)
    assert near(w, w_ref, 1e-6)


@needs_cuda
def test_dispatch_takes_the_kernels():
    """`route_grouped`, `OssMoE` and `OssExperts` take the kernels for a few rows on a GPU, and
    their torch code for more."""
    routed_moe.load_gemv()
    ex = _oss_experts(torch.bfloat16)
    x = torch.randn(2, ex.down_proj.shape[2], device=KERNEL_DEV).to(torch.bfloat16)
    assert routed_moe.few_rows_kernels(x) and ex._gemv(x)
    assert not routed_moe.few_rows_kernels(x.repeat(routed_moe.GEMV_TOKENS, 1))
    cfg = _oss_config(32, x.shape[1], ex.down_proj.shape[1])
    moe = OssMoE(cfg).to(KERNEL_DEV, torch.bfloat16)
    moe.experts = ex
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(32, x.shape[1], device=KERNEL_DEV) * 0.05)
        moe.router.bias.zero_()
    got = moe(x)
    saved = routed_moe._kernels
    routed_moe._kernels = None
    try:
        ref = moe(x)
    finally:
        routed_moe._kernels = saved
    assert near(got, ref, 0.03)
    # (the kernels ran: none fell back to its torch path, `tests/gpu/conftest.py` checks)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("cls", [RMSNorm, FloatProductRMSNorm], ids=lambda c: c.__name__)
def test_row_kernel_norms_match_torch(dtype, cls):
    d = 512
    norm = cls(d, 1e-6).to(KERNEL_DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=_gen(4), device=KERNEL_DEV))
    norm.weight.data = norm.weight.data.to(torch.float32 if cls is FloatProductRMSNorm else dtype)
    x = (torch.randn(5, 3, d, generator=_gen(5), device=KERNEL_DEV) * 3).to(dtype)
    ref = norm(x)
    view = torch.randn(4, d + 64, generator=_gen(6), device=KERNEL_DEV).to(dtype)[:, :d]
    ref_view = norm(view)  # (a slice of wider rows, as MLA norms its latent)
    holder = torch.nn.Sequential(norm)
    assert norms_as_row_kernels(holder) == 1 and norm.row_kernel
    try:
        # (the module takes the kernel on a GPU; through the interpreter, called directly)
        got, got_view = (norm(x), norm(view)) if CUDA else (norm._rows(x), norm._rows(view))
        assert not CUDA or norm._row_kernel_takes(x) and norm._row_kernel_takes(view)
    finally:
        norm.row_kernel = False
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for a, b in ((got, ref), (got_view, ref_view)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("cls", [RMSNorm, FloatProductRMSNorm], ids=lambda c: c.__name__)
def test_row_kernel_add_and_norm_match_torch(dtype, cls):
    """A layer's residual add and its next norm in one row kernel (`RMSNorm.add_forward`, the
    decoder layers off the fused step) against the two torch ops."""
    from layersplit.shards.kernels.row_ops import add_rms_norm

    d = 512
    norm = cls(d, 1e-6).to(KERNEL_DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=_gen(7), device=KERNEL_DEV))
    norm.weight.data = norm.weight.data.to(torch.float32 if cls is FloatProductRMSNorm else dtype)
    h = (torch.randn(3, d, generator=_gen(8), device=KERNEL_DEV) * 3).to(dtype)
    a = torch.randn(3, d, generator=_gen(9), device=KERNEL_DEV).to(dtype)
    want_h, want_n = norm.add_forward(h, a)  # (the torch ops: not switched yet)
    assert torch.equal(want_h, h + a) and torch.equal(want_n, norm(h + a))
    norms_as_row_kernels(torch.nn.Sequential(norm))
    try:
        got_h, got_n = norm.add_forward(h, a) if CUDA else \
            add_rms_norm(h, a, norm.weight, norm.eps, norm.float_product)
    finally:
        norm.row_kernel = False
    assert torch.equal(got_h, want_h)  # (one rounding of the float32 sum, as torch's add)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got_n.float(), want_n.float(), rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.parametrize("experts,hidden", [(64, 2048), (256, 7168)])  # (V2-Lite's, V3's)
def test_router_logits_in_one_gemv_equal_the_float32_linear(experts, hidden):
    """A bfloat16 row against the float32 router weight (`grouped_moe.router_logits`: the GEMV
    without a float32 copy of the row) equals F.linear(x.float(), w) to float32 rounding, and
    the routing picks the same experts from it."""
    routed_moe.load_gemv()
    x = torch.randn(1, hidden, generator=_gen(10), device=KERNEL_DEV).to(torch.bfloat16)
    w = torch.randn(experts, hidden, generator=_gen(11), device=KERNEL_DEV) * hidden ** -0.5
    got = grouped_moe.router_logits(x, w)
    want = F.linear(x.float(), w)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grouped_moe.router_logits(x.repeat(2, 1), w).shape == (2, experts)  # (torch's)


@pytest.mark.parametrize("extra", [1, 2, 3])
def test_grouped_route_appends_the_shared_chunks(extra):
    """`extra` more columns after the k routed ones: ids E .. E + extra - 1, weight 1; the
    routed columns as without them."""
    from layersplit.shards.kernels.moe_gemv import moe_route_grouped
    g = _gen(4)
    e, k = 64, 6
    logits = torch.randn(3, e, generator=g, device=KERNEL_DEV)
    bias = torch.randn(e, generator=g, device=KERNEL_DEV) * 0.3
    w0, idx0 = moe_route_grouped(logits, bias, k, 8, 4, True, 2.5)
    w, idx = moe_route_grouped(logits, bias, k, 8, 4, True, 2.5, extra)
    assert w.shape == idx.shape == (3, k + extra)
    assert torch.equal(idx[:, :k], idx0) and torch.equal(w[:, :k], w0)
    assert torch.equal(idx[:, k:].cpu(), torch.arange(e, e + extra).expand(3, extra))
    assert torch.equal(w[:, k:].cpu(), torch.ones(3, extra))


def _swiglu(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2])
def test_shared_chunks_in_the_experts_kernels_equal_the_shared_mlp(dtype, rows):
    """The routed experts' kernels reading a shared MLP's weights in place as F / I more
    experts of weight 1 (`run_gemv`'s `shared`) give the routed experts' sum plus the shared
    MLP, as the two were computed apart; the layer's residual added in their last launch."""
    from layersplit.shards.kernels.moe_gemv import moe_gemv, moe_route_grouped
    e, h, i, k, f = (64, 2048, 1408, 6, 2816) if CUDA else (8, 64, 24, 3, 48)
    g = _gen(5)
    x = torch.randn(rows, h, generator=g, device=KERNEL_DEV).to(dtype)
    gu = (torch.randn(e, 2 * i, h, generator=g, device=KERNEL_DEV) * h ** -0.5).to(dtype)
    dn = (torch.randn(e, h, i, generator=g, device=KERNEL_DEV) * i ** -0.5).to(dtype)
    sgu = (torch.randn(2 * f, h, generator=g, device=KERNEL_DEV) * h ** -0.5).to(dtype)
    sdn = (torch.randn(h, f, generator=g, device=KERNEL_DEV) * f ** -0.5).to(dtype)
    logits = torch.randn(rows, e, generator=g, device=KERNEL_DEV)
    bias = torch.zeros(e, device=KERNEL_DEV)
    w, idx = moe_route_grouped(logits, bias, k, 1, 1, True, 2.5, f // i)
    got = moe_gemv(x, w, idx, gu, dn, sgu, sdn)
    routed = moe_gemv(x, w[:, :k].contiguous(), idx[:, :k].contiguous(), gu, dn)
    want = routed.float() + _swiglu(sgu.float(), sdn.float(), x.float())
    assert near(got, want, 1e-5 if dtype == torch.float32 else 0.02)
    r = torch.randn(rows, h, generator=g, device=KERNEL_DEV).to(dtype)  # (the layer's residual)
    with_r = moe_gemv(x, w, idx, gu, dn, sgu, sdn, r)
    assert near(with_r, r.float() + got.float(), 1e-6 if dtype == torch.float32 else 0.01)
    with pytest.raises(ValueError, match="shared experts"):  # (a width no multiple of I)
        moe_gemv(x, w, idx, gu, dn, sgu[:-2].contiguous(), sdn[:, :-1].contiguous())
    with pytest.raises(ValueError, match="shared experts"):  # (another hidden size)
        moe_gemv(x, w, idx, gu, dn, sgu[:, :-8].contiguous(), sdn[:-8].contiguous())
    with pytest.raises(ValueError, match="both"):
        moe_gemv(x, w, idx, gu, dn, sgu, None)


def test_grouped_moe_few_rows_take_the_shared_expert_in_the_experts_kernels(monkeypatch):
    """`GroupedMoE`'s few-rows step (`_few_rows`, the kernels' dispatch forced where they run
    here) reads its shared MLP in place as experts and equals its torch path; off with its
    switch."""
    from layersplit.shards.kernels import moe_gemv

    monkeypatch.setattr(routed_moe, "_kernels", moe_gemv)
    monkeypatch.setattr(routed_moe, "few_rows_kernels", lambda x: x.shape[0] <= 4)
    raw = {**FAMILY_CONFIGS["deepseek_v3-noq"], "num_hidden_layers": 4,  # (two shared
           "vocab_size": 320}  # experts: one MLP twice as wide)
    cfg = config_from_hf(raw, "config.json")

    def made() -> grouped_moe.GroupedMoE:
        moe = grouped_moe.GroupedMoE(cfg)
        with torch.no_grad():
            for n, prm in moe.named_parameters():
                prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(
                    len(n))) * 0.3)
        moe = moe.to(KERNEL_DEV)
        moe.fuse()
        return moe

    moe = made()
    assert moe.shared_in_kernels == 2
    x = torch.randn(2, cfg.hidden_size, generator=_gen(8), device=KERNEL_DEV)
    r = torch.randn(2, cfg.hidden_size, generator=_gen(9), device=KERNEL_DEV)
    got = moe(x, residual=r)
    monkeypatch.setattr(routed_moe, "few_rows_kernels", lambda x: False)  # (the torch path)
    want = moe(x, residual=r)
    assert near(got, want, 1e-5)
    monkeypatch.setattr(routed_moe, "_kernels", moe_gemv)
    monkeypatch.setenv(grouped_moe.SHARED_AS_EXPERTS, "0")
    assert made().shared_in_kernels == 0


@needs_cuda
def test_grouped_moe_runs_its_shared_expert_in_the_experts_kernels(monkeypatch):
    """A DeepSeek-V3-style MoE's step of one row takes the shared chunks (four launches after
    the router's GEMV), and equals its step with them off (`SHARED_AS_EXPERTS`) and the torch
    path's."""
    routed_moe.load_gemv()
    raw = {**FAMILY_CONFIGS["deepseek_v3-noq"], "num_hidden_layers": 4, "vocab_size": 320,
           "hidden_size": 2048,
           "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6}
    cfg = config_from_hf(raw, "config.json")
    g = _gen(6)

    def made() -> grouped_moe.GroupedMoE:
        moe = grouped_moe.GroupedMoE(cfg).to(KERNEL_DEV)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=_gen(7), device=KERNEL_DEV) * 0.03)
        moe = moe.to(torch.bfloat16)
        moe.gate.float()  # (the router's float32 tensors)
        moe.fuse()
        return moe

    x = torch.randn(1, 2048, generator=g, device=KERNEL_DEV).to(torch.bfloat16)
    moe = made()
    assert moe.shared_in_kernels == 2
    got = moe(x)
    r = torch.randn(1, 2048, generator=g, device=KERNEL_DEV).to(torch.bfloat16)
    assert torch.equal(moe(x, residual=r), r + got)  # (added in the last launch, as torch adds)
    monkeypatch.setenv(grouped_moe.SHARED_AS_EXPERTS, "0")
    apart = made()
    assert apart.shared_in_kernels == 0
    assert near(got, apart(x), 0.02)
    monkeypatch.setattr(routed_moe, "_kernels", None)  # (the torch path)
    assert near(got, apart(x), 0.03)
