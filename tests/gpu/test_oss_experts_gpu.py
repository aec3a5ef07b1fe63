"""gpt-oss's experts on the GPU (`shards.layers.oss_moe`): the grouped-GEMM path over the
column-major layout `fuse` gives them, and the per-row gather path, against the one-expert-at-a-
time loop (transformers' order), at gpt-oss-20b's expert shape, and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.layers.oss_moe import OssMoE
from layersplit.shards.model_config import config_from_hf

from tests.gpu import near

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _moe(dtype: torch.dtype) -> OssMoE:
    cfg = config_from_hf({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
                          "num_local_experts": 32, "num_experts_per_tok": 4,
                          "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                          "num_hidden_layers": 2, "vocab_size": 1024}, "gpt-oss-20b shape")
    torch.manual_seed(0)
    moe = OssMoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe.to("cuda:0", dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 8, 200])
def test_grouped_and_gathered_experts_match_the_loop(dtype, rows):
    moe = _moe(dtype)
    x = torch.randn(rows, 2880, device="cuda:0").to(dtype)
    ref = moe.experts._loop(x, *_route(moe, x))
    moe.fuse()
    assert moe.experts.gate_up_proj.stride(-2) == 1  # column-major for the grouped GEMM
    got = moe(x)
    assert near(got, ref, 2e-2 if dtype == torch.bfloat16 else 1e-4)


def _route(moe: OssMoE, x: torch.Tensor):
    logits = torch.nn.functional.linear(x, moe.router.weight, moe.router.bias)
    top, idx = torch.topk(logits, moe.top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), idx


def test_experts_in_a_cuda_graph():
    moe = _moe(torch.bfloat16)
    moe.fuse()
    x = torch.randn(4, 2880, device="cuda:0", dtype=torch.bfloat16)
    want = moe(x)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = moe(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert near(out, moe(x), 1e-2) and not torch.equal(out, want)
