"""The hybrid models' GPU path (run on a CUDA machine with fla-core installed:
`python -m pytest -m gpu tests/shards/test_hybrid_gpu.py`).

fla-core's gated-delta-rule kernels against the torch path (the CPU reference) in one Gated
DeltaNet layer: chunked prefill with the state carried from chunk to chunk, then one-token decode
steps; and a tiny Qwen3.5 generated from the CLI on two shards of a GPU, against the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.kernels.gated_delta_fla import (
    ENV_SWITCH,
    delta_rules,
    kernel_failure,
    pick_conv,
)
from layersplit.shards.layers.gated_delta import GatedDeltaNet, causal_conv
from layersplit.shards.sampling import SamplingParams

from tests.gpu import near
from tests.helpers import run_logged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (fla's Triton dots round float32 inputs through TF32: its float32 is not the torch path's)
TOL = {torch.float32: 1e-2, torch.bfloat16: 4e-2}


def _layer(dtype: torch.dtype) -> GatedDeltaNet:
    """Qwen3.5's layout with 2 key heads and 4 value heads (each key head serves two), random
    weights of every size that matters (decays near 1 and far from it)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 4, 64, 64, 4, 1e-6, fused_projections=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        layer.A_log.copy_(torch.linspace(-2.0, 1.0, 4))
    return layer.to("cuda:0", dtype).eval()


def _run(layer, x, spans, monkeypatch, fla: bool):
    """Outputs of each span of `x` ((B, n, hidden)), and the final conv and recurrent state; a
    span of one row is a decode step (the recurrent form)."""
    monkeypatch.setenv(ENV_SWITCH, "1" if fla else "0")
    assert (delta_rules(x.device) is not None) == fla  # fla-core is installed here: it runs
    conv = torch.zeros(x.shape[0], *layer.conv_state_shape(), device=x.device, dtype=x.dtype)
    state = torch.zeros(x.shape[0], *layer.state_shape(), device=x.device)
    with torch.no_grad():
        outs = [layer(x[:, a:b], conv, state)[0] for a, b in spans]
    assert kernel_failure() is None  # (a failed kernel call falls back to the torch path)
    return outs, conv, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_prefill_and_decode_equal_the_torch_path(dtype, monkeypatch):
    """Prefill in chunks that do not end on the delta rule's 64-row chunks (the state carried
    between them), then decode steps: every output and the final states within tolerance."""
    layer = _layer(dtype)
    x = torch.randn(2, 160, 256, generator=torch.Generator().manual_seed(1)).to("cuda:0", dtype)
    spans = [(0, 80), (80, 150), *((t, t + 1) for t in range(150, 160))]
    fla, conv_f, state_f = _run(layer, x, spans, monkeypatch, fla=True)
    ref, conv_t, state_t = _run(layer, x, spans, monkeypatch, fla=False)
    for (a, b), got, want in zip(spans, fla, ref):
        assert near(got, want, TOL[dtype]), (a, b)
    assert torch.equal(conv_f, conv_t)  # (the conv state is the last inputs, copied)
    assert near(state_f, state_t, TOL[dtype])


def test_fla_state_carries_across_chunks(monkeypatch):
    """Chunked prefill with fla: 150 rows in one step or in three (the state carried between
    them) give the same rows and final state."""
    layer = _layer(torch.bfloat16)
    x = torch.randn(1, 150, 256, generator=torch.Generator().manual_seed(2)).to("cuda:0",
                                                                               torch.bfloat16)
    whole, _, state_w = _run(layer, x, [(0, 150)], monkeypatch, fla=True)
    parts, _, state_p = _run(layer, x, [(0, 37), (37, 101), (101, 150)], monkeypatch, fla=True)
    assert near(torch.cat(parts, dim=1), whole[0], TOL[torch.bfloat16])
    assert near(state_p, state_w, TOL[torch.bfloat16])


@pytest.mark.parametrize("n", [1, 2, 3, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_causal_conv_equals_the_torch_conv(n, dtype, monkeypatch):
    """fla's causal conv + SiLU (a prefill chunk's, `pick_conv`) against the torch path's, on
    the strided view a fused projection leaves, after a non-zero state, with chunks shorter
    than the state (their new state is partly the old one): the new state equal, bit for bit
    (it is the last inputs), the output within rounding."""
    monkeypatch.setenv(ENV_SWITCH, "1")
    gen = torch.Generator().manual_seed(n)
    c, k = 96, 4
    proj = torch.randn(2, n, c + 40, generator=gen).to("cuda:0", dtype)
    x = proj[..., :c]  # (row stride c + 40, as `split_projection` leaves it)
    state = torch.randn(2, c, k - 1, generator=gen).to("cuda:0", dtype)
    weight = (torch.randn(c, k, generator=gen) * 0.5).to("cuda:0", dtype)
    assert kernel_failure() is None  # (else the torch path runs from then on)
    conv = pick_conv(x.device, causal_conv)
    assert conv is not causal_conv  # fla-core is installed here: its conv runs
    got, got_state = conv(x, state, weight)
    want, want_state = causal_conv(x, state, weight)
    assert kernel_failure() is None
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got_state, want_state)
    assert near(got, want, TOL[dtype])


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    from layersplit.shards.tiny import write_tiny_hybrid

    # (head dims of 16: the smallest tile of fla's kernels; the CPU tests' tiny model has 8)
    return write_tiny_hybrid(tmp_path_factory.mktemp("hybrid-gpu") / "m", "qwen3_5",
                             linear_key_head_dim=16, linear_value_head_dim=16)


def test_two_shard_cli_generation_on_cuda(tiny_qwen3_5, tmp_path):
    """`layersplit generate` on two shards of one GPU (float32, fla's kernels in each shard):
    the CPU reference's greedy tokens, logits close to its."""
    text = "the quick brown fox jumps over the lazy dog " * 8  # prefill > one delta chunk
    dump = tmp_path / "logits.npy"
    out = subprocess.run(
        [sys.executable, "-m", "layersplit.launch.cli", "generate", text, "--model",
         str(tiny_qwen3_5), "--devices", "cuda:0,cuda:0", "--dtype", "float32",
         "--prefill-chunk", "64", "--max-tokens", "12", "--ignore-eos", "--json",
         "--prefix-cache", "off", "--dump-logits", str(dump)],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("gated delta rule on cuda:0: fla-core") == 2, out.stderr[-3000:]
    assert "gated delta rule failed" not in out.stderr, out.stderr[-3000:]
    got = json.loads(out.stdout)
    ref = ReferenceEngine(tiny_qwen3_5, prefill_chunk=64, max_context=512)
    ids = ref.tokenizer.encode(text)
    assert len(ids) > 64 and got["prompt_tokens"] == len(ids)
    want, want_logits = run_logged(ref, ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert got["tokens"] == want.tokens
    assert near(torch.from_numpy(np.load(dump)), torch.from_numpy(want_logits), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_captured_decode_steps_equal_eager_on_cuda(tiny_qwen3_5, dtype):
    """A hybrid range's decode steps through CUDA graphs (a graph per slot and KV bucket, the
    slot's states advanced in place by the replay), over a paged pool, two sequences
    interleaved: the eager steps' logits, states and tokens; the graphs were captured."""
    from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
    from layersplit.shards.executor import RangeExecutor

    ckpt = open_checkpoint(tiny_qwen3_5)
    exs = [RangeExecutor(load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, "cuda:0"),
                         256, 2, "cuda:0", static_decode=static, graph_bucket=4,
                         paged=(64, 16)) for static in (False, True)]
    for ex in exs:
        ex.kv.set_table(0, 0, list(range(0, 32, 2)))
        ex.kv.set_table(1, 0, list(range(31, 0, -2)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (70,), generator=g), torch.randint(0, 300, (5,), generator=g)]
    tok = [[int(ex.run(p.to("cuda:0"), 0, s).argmax()) for s, p in enumerate(prompts)]
           for ex in exs]
    pos = [70, 5]
    for _ in range(40):
        for slot in (0, 1):
            a, b = (ex.run(torch.tensor([tok[i][slot]], device="cuda:0"), pos[slot], slot)
                    for i, ex in enumerate(exs))
            assert near(b, a, TOL[dtype])
            tok[0][slot], tok[1][slot] = int(a.argmax()), int(a.argmax())  # follow the eager
            pos[slot] += 1
    assert exs[1].static.graphs and {key[0] for key in exs[1].static.graphs} == {0, 1}
    assert near(exs[1].kv.state, exs[0].kv.state, TOL[dtype])


@pytest.fixture(scope="module")
def tiny_hybrids(tmp_path_factory, tiny_qwen3_5):
    """family -> a tiny hybrid folder with fla-sized heads (Qwen3-Next: its regrouped
    in-projection; Qwen3.5-MoE: a sparse MLP after the fused stages)."""
    from layersplit.shards.tiny import write_tiny_hybrid

    root = tmp_path_factory.mktemp("hybrid-gpu-families")
    # every expert taken (top-k = all 4): a bf16 rounding difference cannot flip a routing
    # choice, which would send one path through other experts (a different model) from then on
    return {"qwen3_5": tiny_qwen3_5, **{
        fam: write_tiny_hybrid(root / fam, fam, linear_key_head_dim=16, linear_value_head_dim=16,
                               num_experts_per_tok=4)
        for fam in ("qwen3_next", "qwen3_5_moe")}}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_compiled_steps_equal_unfused_on_cuda(tiny_hybrids, family, dtype):
    """The fused, compiled one-token step (`shards.fused_hybrid`, as a GPU shard installs it)
    inside the CUDA graphs, against the unfused eager range: two sequences over a paged pool,
    interleaved, logits and states within tolerance; the compiled stages ran."""
    from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
    from layersplit.shards.executor import RangeExecutor
    from layersplit.shards.fused import fuse_projections

    ckpt = open_checkpoint(tiny_hybrids[family])
    # [unfused eager, fused captured, unfused eager in float32 (how far bf16 itself goes)]
    models = [load_layer_range(ckpt, 0, ckpt.config.num_layers, dt, "cuda:0")
              for dt in (dtype, dtype, torch.float32)]
    fuse_projections(models[1], compile=True)
    exs = [RangeExecutor(m, 256, 2, "cuda:0", static_decode=static, graph_bucket=4,
                         paged=(64, 16)) for m, static in zip(models, (False, True, False))]
    for ex in exs:
        ex.kv.set_table(0, 0, list(range(0, 32, 2)))
        ex.kv.set_table(1, 0, list(range(31, 0, -2)))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (70,), generator=g), torch.randint(0, 300, (5,), generator=g)]
    def dist(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.abs().max()))

    def close(a: torch.Tensor, b: torch.Tensor, f32: torch.Tensor) -> bool:
        """b (fused) within TOL of a (unfused); in bf16, b no farther from float32 than TOL or
        twice a's own distance from it (b is not compared with a there, a looser check:
        a broken fused step is still far from float32): the two paths round at different
        points (inductor keeps float32 between the fused ops), and a bf16 recurrent state
        carries its rounding from step to step, so each drifts from float32 its own way (b
        against a alone failed at 0.059 where each was ~0.03 from float32: Qwen3-Next, 21
        steps in)."""
        if dtype == torch.float32:
            return dist(b, a) < TOL[dtype]
        return dist(b, f32) < max(TOL[dtype], 2 * dist(a, f32))

    first = [[ex.run(p.to("cuda:0"), 0, s) for s, p in enumerate(prompts)] for ex in exs]
    tok = [int(x.argmax()) for x in first[0]]
    for a, b, f32 in zip(*first):  # prefill chunks on the fused weights
        assert close(a, b, f32)
    pos = [70, 5]
    for _ in range(24):
        for slot in (0, 1):
            a, b, f32 = (ex.run(torch.tensor([tok[slot]], device="cuda:0"), pos[slot], slot)
                         for ex in exs)
            assert close(a, b, f32), (slot, pos[slot], dist(b, a), dist(a, f32))
            tok[slot] = int(a.argmax())  # both follow the eager tokens
            pos[slot] += 1
    fast = models[1].layers[0].fast
    assert fast is not None and fast.compiled  # no fallback to the uncompiled stages
    assert exs[1].static.graphs
    assert close(exs[0].kv.state, exs[1].kv.state, exs[2].kv.state)


def _fused_executors(folder, dtype: torch.dtype, slots: int, blocks: int):
    """Two executors of the whole range as a GPU shard runs it (fused, compiled, decode steps
    captured, over a paged pool of `blocks` blocks of 16): one to test, one to compare with."""
    from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
    from layersplit.shards.executor import RangeExecutor
    from layersplit.shards.fused import fuse_projections

    ckpt = open_checkpoint(folder)
    exs = []
    for _ in range(2):
        m = load_layer_range(ckpt, 0, ckpt.config.num_layers, dtype, "cuda:0")
        fuse_projections(m, compile=True)
        exs.append(RangeExecutor(m, 256, slots, "cuda:0", graph_bucket=4, paged=(blocks, 16)))
    return exs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("graphs", [True, False], ids=["captured", "eager"])
def test_chain_verify_in_one_step_on_cuda(tiny_qwen3_5, dtype, graphs):
    """A shard's hybrid range (fused, compiled) verifies a chain in one step (a verify graph per
    slot and bucket, or eager: `_hybrid_chain`; the verify-rows kernel keeps each row's state)
    with the row-by-row path's logits; two slots verify before either settles, and after each
    number of accepted rows the next (captured) decode step gives the row-by-row executor's
    logits and states; the kernel ran, no fallback."""
    from layersplit.shards.layers import gated_delta

    one, rows = _fused_executors(tiny_qwen3_5, dtype, 2, 64)
    rows.hybrid_chain_verify = False
    assert one.hybrid_chain_verify
    if not graphs:  # (decode steps still captured; verify steps eager)
        one._static_step = lambda n, pos, verify, chain=True: not verify and n == 1 and pos > 0
    for ex in (one, rows):
        ex.kv.set_table(0, 0, list(range(0, 32, 2)))
        ex.kv.set_table(1, 0, list(range(31, 0, -2)))
    calls = []
    inner = one._hybrid_chain
    one._hybrid_chain = lambda *a: calls.append(a[2]) or inner(*a)  # (x, pos, slot, ...)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (70,), generator=g), torch.randint(0, 300, (5,), generator=g)]
    pos = [70, 5]
    for ex in (one, rows):
        for s, p in enumerate(prompts):
            ex.run(p.to("cuda:0"), 0, s)
    chain = torch.randint(0, 300, (8,), generator=g).to("cuda:0")
    for accepts in [(7, 0), (3, 5), (0, 7)]:
        verified = {}
        for slot in (0, 1):
            a, b = (ex.run(chain, pos[slot], slot, all_logits=True, verify=True).clone()
                    for ex in (one, rows))
            assert near(a, b, TOL[dtype])
            verified[slot] = b
        for slot, accepted in zip((0, 1), accepts):
            nxt = pos[slot] + accepted + 1
            follow = torch.tensor([int(verified[slot][accepted].argmax())], device="cuda:0")
            for ex in (one, rows):
                ex.before_step(slot, nxt, None)
            a, b = (ex.run(follow, nxt, slot) for ex in (one, rows))
            assert near(a, b, TOL[dtype])
            assert near(one.kv.state[:, slot], rows.kv.state[:, slot], TOL[dtype])
            pos[slot] = nxt + 1
    assert not gated_delta._rows_failed
    if graphs:
        # (one graph a bucket serves both slots: the slot whose states it reads is an input)
        assert calls == [] and {(k[0], k[2]) for k in one.static.verify_graphs} == {(-1, 8)}
    else:
        assert calls == [0, 1] * 3


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_batched_decode_steps_on_cuda(tiny_hybrids, family):
    """A shard's hybrid range (fused, compiled, over a paged pool) runs the decode rows of three
    sequences as one captured batched step (`run_segments`: each row's state slot a graph
    input), with each sequence's own step's logits (float32), its states advanced as that
    step's, and an idle slot's states untouched; the batched graph was captured."""
    from layersplit.shards.executor import Segment

    bat, one = _fused_executors(tiny_hybrids[family], torch.float32, 4, 96)
    one.batch_decode = False
    for ex in (bat, one):
        for slot in range(4):
            ex.kv.set_table(slot, 0, list(range(slot, 64, 4)))
    g = torch.Generator().manual_seed(6)
    prompts = {s: torch.randint(0, 300, (n,), generator=g) for s, n in enumerate((70, 9, 33, 5))}
    last = {}
    for ex in (bat, one):
        for s, p in prompts.items():
            last[s] = int(ex.run(p.to("cuda:0"), 0, s).argmax())
    idle = bat.kv.save(1)
    live = [3, 0, 2]
    pos = {s: len(prompts[s]) for s in live}
    for _ in range(12):
        x = torch.tensor([last[s] for s in live], device="cuda:0")
        segs = [Segment(s, pos[s], 1) for s in live]
        got, want = (ex.run_segments(x, segs) for ex in (bat, one))
        for i, s in enumerate(live):
            assert near(got[i], want[i], TOL[torch.float32])
            last[s] = int(want[i].argmax())
            pos[s] += 1
    for s in live:
        assert near(bat.kv.state[:, s], one.kv.state[:, s], TOL[torch.float32])
    assert all(torch.equal(a, b) for a, b in zip(bat.kv.save(1), idle))
    assert bat.static.batch_graphs and not one.static.batch_graphs
