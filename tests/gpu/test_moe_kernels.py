"""`shards.kernels.moe_gemv` (the selected experts of a few rows as GEMVs) against the torch
experts (`loop_experts`, transformers' order) on the GPU, at Qwen3-30B-A3B's expert shape, and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers import routed_moe
from layersplit.shards.layers.routed_moe import grouped_experts, loop_experts, route

from tests.gpu import near

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
# (the MoE kernels load on CUDA only: `routed_moe.load_gemv`)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not fused_kernels_available(DEV),
                                 reason="needs a CUDA device and the Triton kernels")]


def _weights(dtype: torch.dtype, e: int = 128, h: int = 2048, i: int = 768):
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, generator=g, device=DEV) * h ** -0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g, device=DEV) * i ** -0.5).to(dtype)
    router = torch.randn(e, h, generator=g, device=DEV).to(dtype)
    return gate_up, down, router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("float_weights", [False, True], ids=["qwen", "mixtral"])
def test_gemv_matches_torch_experts(dtype, rows, float_weights):
    from layersplit.shards.kernels.moe_gemv import moe_gemv
    gate_up, down, router = _weights(dtype)
    x = torch.randn(rows, gate_up.shape[2], device=DEV).to(dtype)
    w, idx = route(x, router, 8, True, float_weights)
    ref = loop_experts(x, w, idx, gate_up, None, None, down)
    got = moe_gemv(x, w, idx, gate_up, down)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert near(got, ref, 1e-4 if dtype == torch.float32 else 0.03)
    routed_moe.load_gemv()
    assert routed_moe._gemv_applies(x, gate_up, down)  # the dispatch takes the GEMVs
    assert near(grouped_experts(x, w, idx, gate_up, down), ref,
                1e-4 if dtype == torch.float32 else 0.03)


def test_gemv_inside_a_fullgraph_compile():
    """The decode step is compiled with fullgraph=True: the dispatch must not break the graph
    (a break made the whole step fall back to eager)."""
    routed_moe.load_gemv()
    gate_up, down, router = _weights(torch.bfloat16)
    x = torch.randn(1, gate_up.shape[2], device=DEV).to(torch.bfloat16)

    def step(x):
        w, idx = route(x, router, 8, True, False)
        return grouped_experts(x, w, idx, gate_up, down) + x

    got = torch.compile(step, fullgraph=True, dynamic=False)(x)
    assert near(got, step(x), 0.03)


def test_gemv_in_a_cuda_graph():
    from layersplit.shards.kernels.moe_gemv import moe_gemv
    gate_up, down, router = _weights(torch.bfloat16)
    x = torch.randn(1, gate_up.shape[2], device=DEV).to(torch.bfloat16)
    w, idx = route(x, router, 8, True, False)
    moe_gemv(x, w, idx, gate_up, down)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(x, w, idx, gate_up, down)
    for seed in range(3):
        x.copy_(torch.randn(1, x.shape[1], device=DEV, generator=torch.Generator(
            device=DEV).manual_seed(seed)).to(torch.bfloat16))
        w2, idx2 = route(x, router, 8, True, False)
        w.copy_(w2)
        idx.copy_(idx2)
        graph.replay()
        assert near(out, loop_experts(x, w, idx, gate_up, None, None, down), 0.03)


@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2), (64, 6)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_kernel_matches_torch_topk(monkeypatch, experts, top_k, norm):
    routed_moe.load_gemv()
    assert routed_moe._kernels is not None
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(8, 256, device=DEV, generator=g).to(torch.bfloat16)
    router = torch.randn(experts, 256, device=DEV, generator=g).to(torch.bfloat16)
    w, idx = route(x, router, top_k, norm, True)
    monkeypatch.setattr(routed_moe, "_kernels", None)
    w_ref, idx_ref = route(x, router, top_k, norm, True)
    # bf16 logits tie often: the picks must have the torch picks' probabilities, in order
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
    assert torch.equal(probs.gather(1, idx), probs.gather(1, idx_ref))
    assert near(w, w_ref, 1e-6)
