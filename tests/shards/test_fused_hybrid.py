"""The fused one-token step of hybrid layers (`shards.fused_hybrid`), run uncompiled on CPU,
against the module's own forward: prefill chunks on the fused weights, decode steps, captured
(static) steps and verify rows, for each hybrid family (Qwen3-Next's regrouped in-projection
included). The GPU tests compare the compiled stages (`tests/shards/test_hybrid_gpu.py`)."""

from __future__ import annotations

import os

import pytest
import torch
from layersplit.shards import fused_hybrid
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import fuse_projections

from tests.helpers import token_ids

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


@pytest.fixture(autouse=True)
def _the_stages_not_the_gemv_step(monkeypatch):
    """These tests are the stages': under Triton's interpreter (`TRITON_INTERPRET=1`) one-row
    steps would take the GEMV step, which tests/gpu/test_hybrid_gemv.py compares with them."""
    monkeypatch.setenv(fused_hybrid.GEMV_SWITCH, "0")



def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32, summed in another order (the conv, the fused GEMMs): 1e-5 of the magnitude."""
    return (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def _fused_range(path, start: int, end: int, calls: list):
    model = load_layer_range(open_checkpoint(path), start, end)
    fuse_projections(model, compile=False)
    fast = model.layers[0].fast
    assert fast is not None and not fast.compiled
    fast.stages = tuple(
        (lambda f: (lambda *a: calls.append(f.__name__) or f(*a)))(f) for f in fast.stages)
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("static", [False, True])
def test_fused_steps_equal_the_module_forward(hybrid_models, family, static):
    """Two shards (split between a linear and an attention layer), prefill in two chunks, 12
    decode steps, then a verify step of 3 rows: logits and every state equal the unfused
    range's."""
    path = hybrid_models[family]
    calls: list[str] = []
    plain = [RangeExecutor(load_layer_range(open_checkpoint(path), a, b), 96, 1,
                           static_decode=static, graph_bucket=16) for a, b in ((0, 3), (3, 6))]
    fused = [RangeExecutor(_fused_range(path, a, b, calls), 96, 1, static_decode=static,
                           graph_bucket=16) for a, b in ((0, 3), (3, 6))]

    def run(exs, ids, pos, **kw):
        x = ids
        for ex in exs:
            x = ex.run(x, pos, all_logits=True, **kw)
        return x

    ids = token_ids(70, seed=3)
    for a, b in ((0, 40), (40, 70)):  # prefill on the fused weights
        want = run(plain, ids[a:b], a)
        assert _close(run(fused, ids[a:b], a), want)
    assert calls == []  # prefill chunks are not one-token steps
    tok, pos = int(want[-1].argmax()), 70
    for _ in range(12):
        want = run(plain, torch.tensor([tok]), pos)
        got = run(fused, torch.tensor([tok]), pos)
        assert _close(got, want), pos
        tok, pos = int(want.argmax()), pos + 1
    assert {"linear_pre", "linear_post", "attn_pre", "attn_post"} <= set(calls)
    rows = torch.tensor([tok, 3, 5])
    assert _close(run(fused, rows, pos, verify=True), run(plain, rows, pos, verify=True))
    for p, f in zip(plain, fused):
        assert torch.allclose(p.kv.state, f.kv.state, atol=1e-5)
        assert torch.allclose(p.kv.conv, f.kv.conv, atol=1e-5)


def test_fusing_frees_the_separate_projections(hybrid_models):
    """The fused weights replace the checkpoint's (no second copy of a layer's projections)."""
    for family in ("qwen3_5", "qwen3_next"):
        model = load_layer_range(open_checkpoint(hybrid_models[family]), 0, 6)
        before = sum(p.numel() for p in model.parameters())
        fuse_projections(model, compile=False)
        assert sum(p.numel() for p in model.parameters()) == before
        names = {n for n, _ in model.named_parameters()}
        assert not any(s in n for n in names for s in ("in_proj_q", "in_proj_b", "in_proj_z",
                                                        "q_proj", "gate_proj"))


def test_switched_off_leaves_the_layers_unfused(hybrid_models, monkeypatch):
    monkeypatch.setenv(fused_hybrid.ENV_SWITCH, "0")
    model = load_layer_range(open_checkpoint(hybrid_models["qwen3_5"]), 0, 6)
    fuse_projections(model, compile=False)
    assert all(layer.fast is None for layer in model.layers)
    assert model.layers[0].linear_attn.in_proj is None


@pytest.mark.parametrize("value,on", [(None, True), ("0", False), ("1", True),
                                      (" Yes ", True), ("off", False), (" No ", False)])
def test_the_gemv_step_is_on_unless_switched_off(hybrid_models, monkeypatch, value, on):
    """`LAYERSPLIT_HYBRID_GEMV` (`kernels.switched_off`: on unless set off) decides whether
    `fuse_hybrid` prepares the layers' zero-centred norms for `HybridFast._gemv_step` (the row
    kernels, which want them too, switched off here); a CPU without Triton's interpreter never
    takes that step."""
    if value is None:
        monkeypatch.delenv(fused_hybrid.GEMV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(fused_hybrid.GEMV_SWITCH, value)
    monkeypatch.setenv(fused_hybrid.ROW_KERNELS_SWITCH, "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = load_layer_range(open_checkpoint(hybrid_models["qwen3_5"]), 0, 6)
    fuse_projections(model, compile=False)
    fast = model.layers[0].fast
    assert fast.gemv is on
    for layer in model.layers:
        assert (layer.zc_weights is not None) is on
        if on:  # (1 + w, float32: `zc_norm`'s scale)
            assert torch.equal(layer.zc_weights[1],
                               1.0 + layer.post_attention_layernorm.weight.float())
    h = torch.zeros(1, model.cfg.hidden_size)
    assert not fast._gemv_takes(model.layers[0], h, type("S", (), {"lo": None})())


@pytest.mark.parametrize("switch,attr,default", [("ONE_PASS_SWITCH", "one_pass", False),
                                                 ("STATE_IN_PLACE_SWITCH", "state_in_place", True),
                                                 ("ROW_KERNELS_SWITCH", "row_kernels", True)])
@pytest.mark.parametrize("value", [None, "0", "1"])
def test_the_gemv_step_variants_follow_their_switches(
        hybrid_models, monkeypatch, switch, attr, default, value):
    """`LAYERSPLIT_HYBRID_ONE_PASS_NORM` (`kernels.switched_on`: off unless set on, measured
    slower) and `LAYERSPLIT_HYBRID_STATE_IN_PLACE` (`kernels.switched_off`: on unless set off,
    measured faster at 8 streams) decide whether the GEMV step's normed projections sum their
    squares in one pass, and whether a captured step advances the recurrent state in place;
    outside a capture it never does. `LAYERSPLIT_HYBRID_ROW_KERNELS` (on unless set off,
    measured faster) whether decode steps' elementwise work runs as `hybrid_row_ops`'s kernels,
    which want the zero-centred norms' float32 scales even with the GEMV step off."""
    name = getattr(fused_hybrid, switch)
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    model = load_layer_range(open_checkpoint(hybrid_models["qwen3_5"]), 0, 6)
    fuse_projections(model, compile=False)
    fast = model.layers[0].fast
    assert getattr(fast, attr) is (default if value is None else value == "1")
    assert not fast._advances_in_place()
    if attr == "row_kernels":
        monkeypatch.setenv(fused_hybrid.GEMV_SWITCH, "0")
        model = load_layer_range(open_checkpoint(hybrid_models["qwen3_5"]), 0, 6)
        fuse_projections(model, compile=False)
        assert (model.layers[0].zc_weights is not None) is (value != "0")


def test_a_stage_failing_under_compile_leaves_the_state_for_the_eager_retry(hybrid_models):
    """A compiled stage that fails (here `linear_post`, once) makes the step run again on the
    eager stages; the first try must not have advanced the slot's conv and recurrent states
    (the retry would advance them twice: wrong tokens from then on)."""
    path = hybrid_models["qwen3_5"]
    plain = RangeExecutor(load_layer_range(open_checkpoint(path), 0, 6), 96, 1)
    model = load_layer_range(open_checkpoint(path), 0, 6)
    fuse_projections(model, compile=False)
    fast = model.layers[0].fast
    failed = []
    import torch._dynamo.exc  # (a torch.compile failure's type: the eager stages take over)

    def flaky_post(*args):
        if not failed:
            failed.append(True)
            raise torch._dynamo.exc.TorchDynamoException("inductor failed (a stand-in)")
        return fused_hybrid.linear_post(*args)

    fast.compiled = True  # as if compiled: a failure falls back to the eager stages
    fast.stages = (fused_hybrid.linear_pre, flaky_post, fused_hybrid.attn_pre,
                   fused_hybrid.attn_post)
    fused = RangeExecutor(model, 96, 1)
    ids = token_ids(20, seed=5)
    want, got = plain.run(ids, 0), fused.run(ids, 0)
    tok = int(want.argmax())
    for pos in range(20, 24):
        want = plain.run(torch.tensor([tok]), pos)
        got = fused.run(torch.tensor([tok]), pos)
        assert _close(got, want), pos
        tok = int(want.argmax())
    assert failed and not fast.compiled  # it failed once, and the eager stages took over
    assert torch.allclose(plain.kv.state, fused.kv.state, atol=1e-5)
    assert torch.allclose(plain.kv.conv, fused.kv.conv, atol=1e-5)


TRITON = f"{os.sep}venv{os.sep}site-packages{os.sep}triton{os.sep}"  # (its folder, here)


def _raised_from(path: str, error: type[BaseException]) -> BaseException:
    """`error` raised by code whose file is `path` (as a traceback records it), called from
    here, through a launcher made with `exec` and a frame of Triton's own package."""
    triton_file = f"{TRITON}compiler{os.sep}compiler.py"
    inner = compile("def compile_it(error):\n    raise error('failed')\n", triton_file, "exec")
    launcher = compile("def launcher(f, error):\n    f(error)\n", "<string>", "exec")
    outer = compile("def launch(launcher, f, error):\n    launcher(f, error)\n", path, "exec")
    scope: dict = {}
    for code in (inner, launcher, outer):
        exec(code, scope)
    try:
        scope["launch"](scope["launcher"], scope["compile_it"], error)
    except error as e:
        return e
    raise AssertionError("nothing raised")


class _TritonError(Exception):  # (a Triton error: its type's module is Triton's)
    __module__ = "triton.compiler.errors"


@pytest.mark.parametrize("where,inductors", [
    (f"{os.sep}venv{os.sep}site-packages{os.sep}torch{os.sep}_inductor{os.sep}runtime"
     f"{os.sep}triton_heuristics.py", True),
    ("CACHE", True),  # (under TORCHINDUCTOR_CACHE_DIR: compile_cache's folder)
    (f"{os.sep}repo{os.sep}shards{os.sep}kernels{os.sep}gemv.py", False),  # (ours)
    (f"{os.sep}opt{os.sep}triton{os.sep}repo{os.sep}shards{os.sep}kernels{os.sep}gemv.py",
     False),  # (ours, in a folder named triton: not Triton's package)
])
def test_a_triton_error_is_inductors_where_inductors_code_launched_it(
        tmp_path, monkeypatch, where, inductors):
    """In the GEMV step our Triton kernels run beside the compiled stages' Inductor-generated
    ones: a Triton error counts as torch.compile's (the stages then run uncompiled, the GEMV
    kernels stay on) where the last frame outside Triton (and `exec`'d launchers) is
    Inductor's, else as the GEMV kernels' (they turn off)."""
    cache = tmp_path / "compile" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(fused_hybrid, "_triton_dir", lambda: TRITON)
    path = str(cache / "ab" / "cabc.py") if where == "CACHE" else where
    e = _raised_from(path, _TritonError)
    assert fused_hybrid.inductor_raised(e) is inductors
    assert fused_hybrid.torch_compile_failure(e) is inductors
    assert fused_hybrid.compile_failure(e)  # (a Triton error in the stages: either way)
