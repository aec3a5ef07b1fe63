"""Programmatic dependent launch (`shards.kernels.pdl`) on a GPU: a captured chain of decode
kernels, each reading the one before it's output, and each output's memory reused by the
allocator for a later one (so a kernel that wrote before its wait would overwrite a row the
kernel before it still reads), equals the same chain launched the plain way, bit for bit, in
graphs and eagerly. A plain torch kernel sits in the chain too (PDL on one side of it only).
Needs a GPU where PDL runs (compute capability 9.0, Triton 3.3 or later)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.kernels import PDL_SWITCH, pdl_enabled

DEV = torch.device("cuda:0")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not pdl_enabled(DEV),
                                 reason="needs a GPU where PDL runs (Hopper, Triton >= 3.3)")]


def _chain(x0: torch.Tensor, weights: list[torch.Tensor], gate_ups: list[torch.Tensor],
           norm_w: torch.Tensor) -> torch.Tensor:
    from layersplit.shards.kernels.gemv import gemv
    from layersplit.shards.kernels.row_ops import add_rms_norm

    h, x = x0, x0
    for i, (w, gu) in enumerate(zip(weights, gate_ups, strict=True)):
        y = gemv(x, w, norm=(norm_w, 1e-6), residual=h)  # (norm prologue, residual epilogue)
        act = gemv(x, gu, gate_up=True)  # (SiLU * up epilogue, of the normed rows): (1, F)
        h, x = add_rms_norm(y, act[:, : y.shape[1]].contiguous() if i % 2 else y, norm_w, 1e-6)
    return h.float().sum() + x.float()  # (the last: a torch kernel)


@pytest.mark.parametrize("layers", [1, 24])
def test_a_chain_under_pdl_equals_the_plain_one(layers, monkeypatch):
    g = torch.Generator().manual_seed(layers)
    k, f = 1024, 2048
    weights = [(torch.randn(k, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16)
               for _ in range(layers)]
    gate_ups = [(torch.randn(2 * f, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16)
                for _ in range(layers)]
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, torch.bfloat16)
    x0 = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    from layersplit.shards.kernels.pdl import pdl

    results = {}
    with torch.inference_mode():
        for mode in ("plain", "pdl"):
            monkeypatch.setenv(PDL_SWITCH, "1" if mode == "pdl" else "0")
            assert bool(pdl(x0)) == (mode == "pdl")  # (the launches below take it, or not)
            eager = _chain(x0, weights, gate_ups, norm_w)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _chain(x0, weights, gate_ups, norm_w)
            replays = []
            for _ in range(5):
                graph.replay()
                replays.append(out.clone())
            torch.cuda.synchronize()
            results[mode] = (eager, replays)
    want = results["plain"][0]
    assert torch.isfinite(want).all()
    for mode, (eager, replays) in results.items():
        assert torch.equal(eager, want), f"{mode}: the eager chain differs from the plain one"
        for i, got in enumerate(replays):
            assert torch.equal(got, want), f"{mode}: replay {i} differs from the plain chain"
