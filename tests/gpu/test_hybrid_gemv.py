"""The hybrid layers' one-row steps through the GEMV kernels (`fused_hybrid.HybridFast.
_gemv_step`, on by default; `LAYERSPLIT_HYBRID_GEMV=0`: the stages) against the fused stages
they replace, and the GEMV's zero-centred norm prologue (`gemv(..., float_product=True)`, and
summed in one pass, `one_pass`) against `fused_hybrid.zc_norm`.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter
(`TRITON_INTERPRET=1`), float32. The kernel modules import Triton: imported where they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards import fused_hybrid
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections
from layersplit.shards.kernels import kernel_failed

from tests.gpu import KERNEL_DEV, kernel_marks, near
from tests.helpers import token_ids

pytestmark = kernel_marks()
CUDA = KERNEL_DEV != "cpu"


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("one_pass", [False, True])
def test_zero_centred_norm_in_the_gemv_equals_the_norm_then_the_linear(rows, gate_up, one_pass):
    """The norm as the GEMV's prologue, or summed in its weights' loop (`one_pass`: one row
    only, without `norm_out`), equals the norm, then the projection."""
    from layersplit.shards.kernels.gemv import gemv

    k, n = (5120, 1024) if CUDA else (96, 40)
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator(device=KERNEL_DEV).manual_seed(0)
    x = (torch.randn(rows, k, generator=g, device=KERNEL_DEV) * 3).to(dtype)
    w = (torch.randn(2 * n if gate_up else n, k, generator=g, device=KERNEL_DEV)
         * k ** -0.5).to(dtype)
    zc = (torch.randn(k, generator=g, device=KERNEL_DEV) * 0.2).to(dtype)  # (stored as w)
    normed = fused_hybrid.zc_norm(x, zc, 1e-6)
    want = F.linear(normed, w)
    if gate_up:
        gg, u = want.chunk(2, dim=-1)
        want = F.silu(gg) * u
    scale = (1.0 + zc.float()).contiguous()
    if one_pass and rows > 1:
        with pytest.raises(ValueError, match="one_pass takes one row"):
            gemv(x, w, norm=(scale, 1e-6), float_product=True, gate_up=gate_up, one_pass=True)
        return
    if one_pass:
        with pytest.raises(ValueError, match="norm_out"):
            gemv(x, w, norm=(scale, 1e-6), float_product=True, one_pass=True,
                 norm_out=torch.empty_like(x))
        with pytest.raises(ValueError, match="no norm"):
            gemv(x, w, one_pass=True)
    # (the normed row, written by the GEMV)
    out = torch.empty_like(x) if rows == 1 and not one_pass else None
    got = gemv(x, w, norm=(scale, 1e-6), float_product=True, gate_up=gate_up, norm_out=out,
               one_pass=one_pass)
    assert near(got, want, 1e-5 if dtype == torch.float32 else 0.02)
    if out is not None:  # (its one rounding, as `zc_norm`'s: bit for bit in any dtype)
        assert torch.equal(out, normed)
    with pytest.raises(ValueError, match="float32 weight"):
        gemv(x, w, norm=(zc.to(torch.bfloat16), 1e-6), float_product=True)


def _executor(path, monkeypatch, gemv: bool, graphs: bool, compile: bool,
              extra: str | None = None) -> RangeExecutor:
    monkeypatch.setenv(fused_hybrid.GEMV_SWITCH, "1" if gemv else "0")
    monkeypatch.setenv(fused_hybrid.ONE_PASS_SWITCH, "1" if extra == "one_pass" else "0")
    monkeypatch.setenv(fused_hybrid.STATE_IN_PLACE_SWITCH,
                       "1" if extra in ("in_place", "new_state") else "0")
    monkeypatch.setenv(fused_hybrid.ROW_KERNELS_SWITCH,  # (the stages' executor: compiled)
                       "1" if extra == "row_kernels" and gemv else "0")
    model = load_layer_range(open_checkpoint(path), 0, 6, torch.float32, KERNEL_DEV)
    fuse_projections(model, compile=compile)
    assert (model.layers[0].zc_weights is not None) == gemv
    return RangeExecutor(model, 96, 1, KERNEL_DEV, static_decode=graphs)


@pytest.mark.parametrize("family,how,extra", [
    (family, how, None) for family in ("qwen3_5", "qwen3_next", "qwen3_5_moe")
    for how in ["eager", "graphs"] + (["compiled graphs"] if CUDA else [])] + [
    ("qwen3_5", "eager", "one_pass"), ("qwen3_5", "eager", "in_place"),
    ("qwen3_5", "eager", "new_state")] + [
    (family, "eager", "row_kernels") for family in ("qwen3_5", "qwen3_next", "qwen3_5_moe")] + (
    [("qwen3_5", "compiled graphs", "one_pass"), ("qwen3_5", "compiled graphs", "in_place"),
     ("qwen3_next", "graphs", "in_place"), ("qwen3_5", "graphs", "row_kernels"),
     ("qwen3_5", "compiled graphs", "row_kernels")] if CUDA else []))
def test_one_row_steps_take_the_gemv_kernels_and_equal_the_stages(hybrid_models, monkeypatch,
                                                                  family, how, extra):
    """Every layer of a one-row step goes through `_gemv_step` (linear and full attention, a
    dense and a sparse MLP) and its logits and states equal the fused stages' within float32
    summation order; a prefill chunk does not take it. In CUDA graphs (where they run) the
    captured steps replay it without calling it again; compiled, its stages compiled apart.
    `one_pass`: the normed projections sum the row's squares in their weights' loop;
    `in_place`: the verify rows' kernel advancing the recurrent state in place (inside a
    capture; eager here, where no capture runs, by the test's say); `new_state`: the same kernel
    outside a capture, into a new state copied back last; `row_kernels`: the elementwise work
    between the GEMVs as `hybrid_row_ops`'s kernels, no stage compiled."""
    if extra == "in_place" and how == "eager":
        monkeypatch.setattr(fused_hybrid.HybridFast, "_advances_in_place",
                            lambda self: self.state_in_place)
    in_place = []
    if extra in ("in_place", "new_state"):  # (the kernel's calls counted)
        from layersplit.shards.kernels import gated_delta_rows

        rows = gated_delta_rows.recurrent_rows
        monkeypatch.setattr(gated_delta_rows, "recurrent_rows",
                            lambda q, *a: in_place.append(q.shape) or rows(q, *a))
    row_ops = []
    if extra == "row_kernels":  # (each kernel's calls counted)
        from layersplit.shards.kernels import hybrid_row_ops

        for name in ("conv_gates", "gated_norm", "zc_rope_qk", "sigmoid_gate"):
            real_op = getattr(hybrid_row_ops, name)
            monkeypatch.setattr(hybrid_row_ops, name,
                                lambda *a, _n=name, _f=real_op: row_ops.append(_n) or _f(*a))
    calls = []
    real = fused_hybrid.HybridFast._gemv_step
    monkeypatch.setattr(fused_hybrid.HybridFast, "_gemv_step",
                        lambda self, layer, *a: calls.append(layer.linear) or
                        real(self, layer, *a))
    path = hybrid_models[family]
    graphs, compile = how != "eager", how == "compiled graphs"
    stages, kernels = (_executor(path, monkeypatch, gemv, graphs, compile, extra if gemv else None)
                       for gemv in (False, True))
    fast = kernels.model.layers[0].fast
    assert (fast.one_pass, fast.state_in_place) == (extra == "one_pass",
                                                    extra in ("in_place", "new_state"))
    ids = token_ids(30, seed=5).to(KERNEL_DEV)
    want, got = stages.run(ids, 0, all_logits=True), kernels.run(ids, 0, all_logits=True)
    assert near(got, want, 1e-5) and calls == []
    tok, pos = int(want[-1].argmax()), 30
    for _ in range(4):
        want = stages.run(torch.tensor([tok], device=KERNEL_DEV), pos)
        got = kernels.run(torch.tensor([tok], device=KERNEL_DEV), pos)
        assert near(got, want, 1e-5), pos
        tok, pos = int(want.argmax()), pos + 1
    if graphs and CUDA:  # (captured once in the first step's bucket: its warm-ups and capture)
        assert len(calls) % 6 == 0 and calls and set(calls) == {True, False}
    else:
        assert len(calls) == 4 * 6 and set(calls) == {True, False}
    assert near(kernels.kv.state, stages.kv.state, 1e-5)
    assert near(kernels.kv.conv, stages.kv.conv, 1e-5)
    assert bool(in_place) == (extra in ("in_place", "new_state"))  # (the kernel ran, or not)
    if extra == "row_kernels":  # (every one of them ran, and none failed)
        assert set(row_ops) == {"conv_gates", "gated_norm", "zc_rope_qk", "sigmoid_gate"}
        assert not kernel_failed(fused_hybrid.ROW_KERNELS)


def test_one_pass_with_a_bias_and_a_residual_equals_the_norm_then_the_linear():
    """`one_pass` beside the epilogues a normed GEMV may carry: the bias added to the scaled
    sums, then the residual."""
    from layersplit.shards.kernels.gemv import gemv

    k, n = (5120, 256) if CUDA else (100, 24)
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator(device=KERNEL_DEV).manual_seed(3)
    x = (torch.randn(1, k, generator=g, device=KERNEL_DEV) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g, device=KERNEL_DEV) * k ** -0.5).to(dtype)
    b, r = (torch.randn(1, n, generator=g, device=KERNEL_DEV).to(dtype) for _ in range(2))
    zc = (torch.randn(k, generator=g, device=KERNEL_DEV) * 0.2).to(dtype)
    want = r + F.linear(fused_hybrid.zc_norm(x, zc, 1e-6), w, b[0])
    got = gemv(x, w, bias=b[0], residual=r, norm=((1.0 + zc.float()).contiguous(), 1e-6),
               float_product=True, one_pass=True)
    assert near(got, want, 1e-5 if dtype == torch.float32 else 0.02)


@pytest.mark.parametrize("k", [4096, 4100])
def test_the_wide_launch_shape_equals_the_linear(k):
    """`fused_hybrid.plain_launch` (blocks of 2 x 1,024 for 4,096+ inputs), on whole blocks
    and a last one masked, with the residual epilogue."""
    from layersplit.shards.kernels.gemv import gemv

    assert fused_hybrid.plain_launch(k) == fused_hybrid.WIDE_ROWS
    assert fused_hybrid.plain_launch(4095) is None
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator(device=KERNEL_DEV).manual_seed(k)
    x = torch.randn(1, k, generator=g, device=KERNEL_DEV).to(dtype)
    w = (torch.randn(13, k, generator=g, device=KERNEL_DEV) * k ** -0.5).to(dtype)
    r = torch.randn(1, 13, generator=g, device=KERNEL_DEV).to(dtype)
    got = gemv(x, w, residual=r, cfg=fused_hybrid.plain_launch(k))
    assert near(got, r + F.linear(x, w), 1e-5 if dtype == torch.float32 else 0.02)


@pytest.mark.parametrize("failure", ["kernel", "torch.compile", "rows kernel", "row kernels"])
def test_a_gemv_step_failing_midway_leaves_the_states_for_the_stages(hybrid_models, monkeypatch,
                                                                     failure):
    """A GEMV kernel failing in the middle of a one-row step (here gate/up's, after the delta
    rule ran), or torch.compile failing in one of its compiled stages: the step runs again on
    the stages with the slot's states advanced once (equal to the stages' run), the first
    turning the GEMV kernels off, the second the compilation (the kernels stay on). The delta
    rule's rows kernel failing turns off that kernel alone: fla's rule answers in the same
    GEMV step. One of the elementwise row kernels failing (`ROW_KERNELS_SWITCH`, here the
    gated norm's, after the delta rule ran) turns them alone off: the same GEMV step runs again
    with the compiled stages' work."""
    from layersplit.shards import kernels
    from layersplit.shards.kernels import gated_delta_rows, hybrid_row_ops
    from layersplit.shards.kernels import gemv as gemv_mod

    path = hybrid_models["qwen3_5"]
    extra = {"rows kernel": "in_place", "row kernels": "row_kernels"}.get(failure)
    stages, fused = (_executor(path, monkeypatch, gemv, False, False, extra)
                     for gemv in (False, True))
    fast = fused.model.layers[0].fast
    ids = token_ids(20, seed=3).to(KERNEL_DEV)
    stages.run(ids, 0)
    fused.run(ids, 0)
    broken = [True]
    if failure == "kernel":
        real = gemv_mod.gemv

        def gemv(x, w, **kw):
            if kw.get("gate_up") and broken:
                broken.pop()
                raise RuntimeError("a kernel's launch failed")
            return real(x, w, **kw)
        monkeypatch.setattr(gemv_mod, "gemv", gemv)
    elif failure == "rows kernel":
        assert fast.state_in_place

        def rows(*a, **kw):
            broken.pop()
            raise RuntimeError("the rows kernel's launch failed")
        monkeypatch.setattr(gated_delta_rows, "recurrent_rows", rows)
    elif failure == "row kernels":
        assert fast.row_kernels

        def gated_norm(*a):
            broken.pop()
            raise RuntimeError("the gated norm's launch failed")
        monkeypatch.setattr(hybrid_row_ops, "gated_norm", gated_norm)
    else:
        import torch._dynamo.exc as dexc

        fast.compiled = True  # (as if compiled: its failure is torch.compile's)
        lin_gate = fast.gemv_stages[1]

        def failing(*a):
            if broken:
                broken.pop()
                raise dexc.TorchRuntimeError("inductor failed")
            return lin_gate(*a)
        fast.gemv_stages = (fast.gemv_stages[0], failing, *fast.gemv_stages[2:])
    tok = torch.tensor([7], device=KERNEL_DEV)
    for pos in (20, 21):
        want, got = stages.run(tok, pos), fused.run(tok, pos)
        assert near(got, want, 1e-5), pos
    assert near(fused.kv.state, stages.kv.state, 1e-5)
    assert near(fused.kv.conv, stages.kv.conv, 1e-5)
    assert not broken  # (the failure happened)
    assert kernels.kernel_failed(fused_hybrid.GEMV) == (failure == "kernel")
    assert kernels.kernel_failed(fused_hybrid.ROWS_KERNEL) == (failure == "rows kernel")
    assert kernels.kernel_failed(fused_hybrid.ROW_KERNELS) == (failure == "row kernels")
    assert fast.compiled is False
    for name in (fused_hybrid.GEMV, fused_hybrid.ROWS_KERNEL,  # (this test's failures:
                 fused_hybrid.ROW_KERNELS):
        kernels._FAILED.discard(name)  # conftest's check)


@pytest.mark.parametrize("family,how", [
    ("qwen3_5", how) for how in ("new states", "in place", "kernel fails", "row kernels",
                                 "row kernels fail", "row kernels, no GEMV step")] + [
    ("qwen3_5_moe", "row kernels")])
def test_batched_steps_over_the_slots_equal_each_sequence_alone(hybrid_models, monkeypatch,
                                                                family, how):
    """`LAYERSPLIT_HYBRID_STATE_IN_PLACE=1` in a batched decode step (`HybridFast._slots_rule`):
    each row's delta rule reads its slot's state in the pool, advanced there (`in place`: as
    inside a capture, by the test's say) or into new states written back last; each
    sequence's logits and states are those of its own steps, the idle slot left as it was.
    `kernel fails`: its first launch raises; the gathered states and fla's (here torch's) rule
    answer, and the kernel is off from then on. `row kernels`: the stages' elementwise work
    through `hybrid_row_ops`'s kernels (`LAYERSPLIT_HYBRID_ROW_KERNELS`), no stage compiled;
    `row kernels fail`: the first of them raises, and the step runs again without them; `no
    GEMV step`: with `LAYERSPLIT_HYBRID_GEMV=0` (they take the batched steps all the same)."""
    from layersplit.shards import kernels
    from layersplit.shards.kernels import gated_delta_rows, hybrid_row_ops

    from tests.helpers import token_ids as ids_of

    monkeypatch.setenv(fused_hybrid.STATE_IN_PLACE_SWITCH, "1")
    monkeypatch.setenv(fused_hybrid.ROW_KERNELS_SWITCH, "1" if "row" in how else "0")
    monkeypatch.setenv(fused_hybrid.GEMV_SWITCH, "0" if "no GEMV" in how else "1")
    row_ops = []
    for name in ("conv_gates", "gated_norm", "zc_rope_qk", "sigmoid_gate"):
        real_op = getattr(hybrid_row_ops, name)

        def op(*a, _n=name, _f=real_op):
            row_ops.append(_n)
            if how == "row kernels fail":
                raise RuntimeError("a row kernel failed to build")
            return _f(*a)
        monkeypatch.setattr(hybrid_row_ops, name, op)
    if how == "in place":
        monkeypatch.setattr(fused_hybrid.HybridFast, "_advances_in_place", lambda self: True)
    calls = []
    rows = gated_delta_rows.recurrent_rows

    def counted(*a):
        calls.append(len(a) == 8)
        if how == "kernel fails":
            raise RuntimeError("the rows kernel failed to build")
        return rows(*a)
    monkeypatch.setattr(gated_delta_rows, "recurrent_rows", counted)
    ckpt = open_checkpoint(hybrid_models[family])
    models = [load_layer_range(ckpt, 0, 6, torch.float32, KERNEL_DEV) for _ in range(2)]
    fuse_projections(models[0], compile=False)
    bat, one = (RangeExecutor(m, 96, 4, KERNEL_DEV, static_decode=st, graph_bucket=4,
                              paged=(96, 8)) for m, st in zip(models, (True, False)))
    for ex in (bat, one):
        for slot in range(4):
            ex.kv.set_table(slot, 0, list(range(slot, 48, 4)))
    prompts = {s: ids_of(n, seed=s + 1).to(KERNEL_DEV) for s, n in enumerate((9, 5, 14, 3))}
    last = {}
    for ex in (bat, one):
        for slot, ids in prompts.items():
            last[slot] = int(ex.run(ids, 0, slot).argmax())
    idle = bat.kv.save(1)
    live = [3, 0, 2]
    pos = {s: len(prompts[s]) for s in live}
    for _ in range(3):
        x = torch.tensor([last[s] for s in live], device=KERNEL_DEV)
        got = bat.static.run_batch(x, live, [pos[s] for s in live])
        for i, s in enumerate(live):
            want = one.run(x[i:i + 1], pos[s], s)
            assert near(got[i:i + 1], want, 1e-4)
            last[s] = int(want.argmax())
            pos[s] += 1
    for s in live:
        for a, b in zip(bat.kv.save(s), one.kv.save(s)):
            assert near(a.float(), b.float(), 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(bat.kv.save(1), idle))
    assert calls and all(calls)  # (every batched linear layer's rule: the rows kernel, slots)
    if how == "kernel fails":  # (tried once, then off)
        assert len(calls) == 1 and kernels.kernel_failed(fused_hybrid.ROWS_KERNEL)
        kernels._FAILED.discard(fused_hybrid.ROWS_KERNEL)  # (this test's: conftest's check)
    if how in ("row kernels", "row kernels, no GEMV step"):  # (every one, in batched steps)
        assert set(row_ops) == {"conv_gates", "gated_norm", "zc_rope_qk", "sigmoid_gate"}
        assert not kernels.kernel_failed(fused_hybrid.ROW_KERNELS)
    elif how == "row kernels fail":  # (tried once, then off)
        assert len(row_ops) == 1 and kernels.kernel_failed(fused_hybrid.ROW_KERNELS)
        kernels._FAILED.discard(fused_hybrid.ROW_KERNELS)
    else:
        assert row_ops == []
