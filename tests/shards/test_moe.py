"""Mixture-of-experts layers: the grouped (GPU, graph-capturable) expert path equals the exact
per-expert loop; the fused decode step equals the plain one; experts load from every layout a
checkpoint may store them in, for the layer range only. (Parity with transformers is in
test_model_parity.py: the MoE tiny configs are in FAMILY_CONFIGS.)"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.errors import CheckpointError
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections
from layersplit.shards.layers.routed_moe import grouped_experts, loop_experts, route
from layersplit.shards.tiny import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from tests.helpers import step_rows
from tests.shards.test_batched_decode import PROMPT_LENS, _prefilled, _reference

MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")


@pytest.mark.parametrize("n,norm,float_weights", [(1, True, False), (7, False, True),
                                                  (40, True, True)])
def test_grouped_experts_equal_loop(n, norm, float_weights):
    g = torch.Generator().manual_seed(n)
    e, h, i, k = 6, 16, 8, 3
    x = torch.randn(n, h, generator=g)
    router = torch.randn(e, h, generator=g)
    gate, up, down = (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g),
                      torch.randn(e, h, i, generator=g))
    w, idx = route(x, router, k, norm, float_weights)
    assert idx.shape == (n, k) and (w.sum(-1) - 1).abs().max() < 1e-6 if norm else True
    want = loop_experts(x, w, idx, None, gate, up, down)
    got = grouped_experts(x, w, idx, torch.cat([gate, up], dim=1), down)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # without grouped GEMMs: each row's weights gathered
    import layersplit.shards.layers.routed_moe as moe

    saved, moe._grouped_mm = moe._grouped_mm, None
    try:
        assert not moe.grouped_gemm_applies(x)
        got = grouped_experts(x, w, idx, torch.cat([gate, up], dim=1), down)
    finally:
        moe._grouped_mm = saved
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # by hand, for one row: the k chosen experts weighted by their router weights
    r = 0
    y = sum(w[r, j] * down[idx[r, j]] @ (torch.nn.functional.silu(gate[idx[r, j]] @ x[r])
                                         * (up[idx[r, j]] @ x[r])) for j in range(k))
    assert torch.allclose(want[r], y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["glm", "qwen"])
def test_bfloat16_experts_sum_as_transformers(weights):
    """In bfloat16, each row's k weighted expert outputs are summed as transformers' experts
    (its default `grouped_mm` path) sum them: in float32, rounded once, bit for bit. Added one
    at a time into a bfloat16 sum they rounded k times (and, with GLM's float32 router weights,
    once more each): GLM-4.5-Air's 8 experts drifted further from float32 than transformers."""
    transformers = pytest.importorskip("transformers")  # a declared test dependency
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts

    e, h, i, k, n = 8, 64, 32, 4, 20
    cfg = transformers.Glm4MoeConfig(hidden_size=h, moe_intermediate_size=i,
                                     n_routed_experts=e, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"  # (what from_pretrained picks)
    theirs = Glm4MoeExperts(cfg)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(torch.bfloat16)
    theirs.gate_up_proj.data, theirs.down_proj.data = gate_up, down
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g).to(weights)
    with torch.no_grad():
        want = theirs(x, idx, w)
    assert want.dtype == torch.bfloat16
    assert torch.equal(loop_experts(x, w, idx, gate_up, None, None, down), want)
    assert torch.equal(grouped_experts(x, w, idx, gate_up, down), want)


@pytest.mark.parametrize("family", MOE)
def test_fused_moe_decode_equals_separate(tiny_models, family):
    """The GPU layout (fused gate/up experts as grouped GEMMs, `shards.fused_moe`) run
    uncompiled on CPU gives the plain path's logits: decode steps and a token-tree verify."""
    ckpt = open_checkpoint(tiny_models[family])
    plain = RangeExecutor(load_layer_range(ckpt, 0, 6), 96, static_decode=True, graph_bucket=32)
    model = load_layer_range(ckpt, 0, 6)
    fuse_projections(model, compile=False)
    fused = RangeExecutor(model, 96, static_decode=True, graph_bucket=32)
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(4))
    assert (plain.run(ids, 0) - fused.run(ids, 0)).abs().max().item() < 1e-5
    for pos in range(20, 36):
        a, b = plain.run(torch.tensor([9]), pos), fused.run(torch.tensor([9]), pos)
        assert (a - b).abs().max().item() < 1e-5
    rows = torch.tensor([9, 3, 5, 7, 2])
    a, b = (ex.run(rows, 36, all_logits=True, verify=True, tree=[0, 1, 1, 0])
            for ex in (plain, fused))
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_batched_step_equals_eager_steps(tiny_models, family, fused):
    """A batched decode step of a MoE range (rows grouped by expert; DeepSeek-V3's latent
    attention over each sequence's rows) equals each row's own eager step."""
    ckpt = open_checkpoint(tiny_models[family])
    ex = _prefilled(ckpt, 1, 5, fused)
    ref = _reference(ckpt, 1, 5, ex)
    slots = [4, 0, 1, 3]
    positions = [PROMPT_LENS[s] for s in slots]
    for step in range(2):
        x = step_rows(ex.model, len(slots), seed=100 + step)
        out = ex.static.run_batch(x, slots, positions)
        want = torch.cat([ref.run(x[i:i + 1], p, s)
                          for i, (s, p) in enumerate(zip(slots, positions))])
        # float32 rounding of hidden rows that reach ~10 (weights at the tiny models' scale)
        assert torch.allclose(out, want, atol=1e-5 * max(1.0, want.abs().max().item()),
                              rtol=1e-5)
        positions = [p + 1 for p in positions]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_layouts_load_the_same_weights(tmp_path, family):
    per = write_tiny_checkpoint(tmp_path / "per", family, num_layers=4)
    fused = write_tiny_checkpoint(tmp_path / "fused", family, num_layers=4,
                                  expert_layout="fused")
    names = load_file(str(per / "model.safetensors")).keys()
    expert0 = ("model.layers.1.block_sparse_moe.experts.0.w1.weight" if family == "mixtral"
               else "model.layers.1.mlp.experts.0.gate_proj.weight")
    assert expert0 in names
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(
        str(fused / "model.safetensors"))
    a = load_layer_range(open_checkpoint(per), 1, 3).state_dict()
    b = load_layer_range(open_checkpoint(fused), 1, 3).state_dict()
    assert a.keys() == b.keys() and "layers.0.mlp.experts.gate_proj" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_only_the_ranges_experts_are_read(tmp_path):
    """A checkpoint holding only layers 2..3 (as a shard's own files could) loads range 2:4."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3_moe", num_layers=6)
    state = load_file(str(path / "model.safetensors"))
    keep = {k: v for k, v in state.items() if k.startswith(("model.layers.2.",
                                                            "model.layers.3."))}
    save_file(keep, str(path / "model.safetensors"))
    mid = load_layer_range(open_checkpoint(path), 2, 4)
    assert mid.layers[1].mlp.experts.down_proj.shape == (8, 64, 32)
    with pytest.raises(CheckpointError, match="model.layers.4."):
        load_layer_range(open_checkpoint(path), 3, 5)


def test_missing_experts_are_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3_moe", num_layers=2)
    state = load_file(str(path / "model.safetensors"))
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != gone}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_layer_range(open_checkpoint(path), 0, 2)
    save_file({k: v for k, v in state.items() if ".experts." not in k or ".layers.0." in k},
              str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="gate_up_proj.*per-expert"):
        load_layer_range(open_checkpoint(path), 1, 2)
    assert load_layer_range(open_checkpoint(path), 0, 1).num_layers == 1


@pytest.mark.parametrize("f,width", [(48, 24), (48, 16), (24, 24), (40, 24)])
def test_shared_expert_chunks_sum_to_the_mlp(f, width):
    """A shared SwiGLU MLP read as F / I experts of the routed experts' width I, as the MoE
    kernels read it in place (`gemv_operands.shared_chunks`, `moe_gemv.run_gemv`'s `shared`:
    chunk c its gate rows c * I .., its up rows F + c * I .., its down columns c * I ..): their
    outputs' sum is the MLP's; a width that does not divide F, a gate/up that is no pair with
    the down weight, or a strided weight gives None."""
    import torch.nn.functional as F
    from layersplit.shards.kernels.gemv_operands import shared_chunks

    g = torch.Generator().manual_seed(f + width)
    h = 32
    gate_up = torch.randn(2 * f, h, generator=g, dtype=torch.float64)
    down = torch.randn(h, f, generator=g, dtype=torch.float64)
    x = torch.randn(3, h, generator=g, dtype=torch.float64)
    count = shared_chunks(gate_up, down, width)
    if f % width:
        assert count is None
        return
    assert count == f // width
    flat_gu, flat_dn = gate_up.flatten(), down.flatten()

    def chunk(c: int) -> torch.Tensor:  # (the kernels' addressing: `moe_gemv._expert`)
        i, hh = torch.arange(width), torch.arange(h)
        gate = flat_gu[c * width * h + i[:, None] * h + hh[None, :]]
        up = flat_gu[c * width * h + (f + i[:, None]) * h + hh[None, :]]
        dn = flat_dn[c * width + hh[:, None] * f + i[None, :]]
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), dn)

    gg, uu = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(sum(chunk(c) for c in range(count)),
                               F.linear(F.silu(gg) * uu, down), rtol=1e-12, atol=1e-12)
    assert shared_chunks(gate_up[:-1], down, width) is None  # (not a gate/up pair)
    assert shared_chunks(gate_up, down.t().contiguous().t(), width) is None  # (strided)
