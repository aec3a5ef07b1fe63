"""The one-row GEMV kernels (`shards.kernels.gemv`: the norm prologue, the residual and
SiLU * up epilogues) against the torch ops they replace, and their place in the decode step.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: float32 within 1e-5 of the torch ops per unit
of the result's largest magnitude; bf16 within 2 bf16 steps of a float32 reference computed
from the same bf16 inputs, rounded as the torch ops round (the kernel sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layersplit.shards.fused import rms_norm
from layersplit.shards.kernels import fused_kernels_available

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)
from tests.gpu.test_decode_kernels import _executor

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])


def _want(x, w, nw, bias, res, gate_up):
    """The torch ops the kernel replaces, in float32 from the same (rounded) inputs, each
    intermediate rounded to the inputs' dtype as the torch ops round it."""
    dt = x.dtype
    if nw is not None:
        x = rms_norm(x.float(), nw.float(), 1e-5).to(dt)
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dt)
    if gate_up:
        g, u = y.chunk(2, dim=-1)
        y = (F.silu(g.float()).to(dt).float() * u.float()).to(dt)
    if res is not None:
        y = (res.float() + y.float()).to(dt)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["plain", "norm+bias", "residual", "gate_up", "head"])
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (100, 300), (64, 1536), (7, 4096)])
@pytest.mark.parametrize("m", [1, 3, 31], ids=lambda m: f"{m}rows")
def test_gemv_matches_torch(m, n, k, kind, dtype):
    """One row (`_gemv`) and a few (`_gemm_rows`: a verify tree, a batch)."""
    from layersplit.shards.kernels.gemv import gemv

    g = torch.Generator().manual_seed(n * 7 + k + m)
    rows = 2 * n if kind == "gate_up" else n
    x = (torch.randn(m, k, generator=g) * 3).to(DEV, dtype)
    w = (torch.randn(rows, k, generator=g) * k ** -0.5).to(DEV, dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DEV, dtype) \
        if kind in ("norm+bias", "head", "gate_up") else None
    bias = torch.randn(n, generator=g).to(DEV, dtype) if kind == "norm+bias" else None
    res = torch.randn(m, n, generator=g).to(DEV, dtype) if kind == "residual" else None
    got = gemv(x, w, bias=bias, norm=None if nw is None else (nw, 1e-5), residual=res,
               gate_up=kind == "gate_up", out_dtype=torch.float32 if kind == "head" else None,
               head=kind == "head")  # (the head's own launch shapes)
    want = _want(x, w, nw, bias, res, kind == "gate_up")
    assert got.shape == (m, n)
    assert got.dtype == (torch.float32 if kind == "head" else dtype)
    scale = max(1.0, float(want.float().abs().max()))
    err = float((got.float() - want.float()).abs().max())
    if dtype == torch.float32:
        assert err <= 1e-5 * scale, err
    else:  # two bf16 steps of the largest value (a sum order apart, then one rounding)
        assert err <= 2 * 2.0 ** -7 * scale, err
        if kind == "head":  # the stored float32 is the bf16 rounding of the result
            assert bool((got == got.to(dtype).float()).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_wide_normed_launch_equals_the_default_one(dtype, monkeypatch):
    """`LAYERSPLIT_GEMV_NORM_WIDE` (on unless 0): a normed projection of 5120 outputs from
    2048 inputs in blocks of 8 rows gives the blocks of 2's result bit for bit (each row's sum
    is the same sequence of blocks), and the torch ops' within the tolerance above."""
    from layersplit.shards.kernels.gemv import NORM_WIDE_SWITCH, config, gemv

    n, k = 5120, 2048
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1, k, generator=g) * 3).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DEV, dtype)
    monkeypatch.setenv(NORM_WIDE_SWITCH, "0")
    assert config(k, norm=True, n=n)["BLOCK_N"] == 2
    plain = gemv(x, w, norm=(nw, 1e-5))
    monkeypatch.delenv(NORM_WIDE_SWITCH)
    assert config(k, norm=True, n=n)["BLOCK_N"] == 8
    assert config(k, norm=True, n=3648)["BLOCK_N"] == 2  # (DeepSeek-V2-Lite's, unmeasured)
    wide = gemv(x, w, norm=(nw, 1e-5))
    assert torch.equal(wide, plain)
    want = _want(x, w, nw, None, None, False)
    scale = max(1.0, float(want.float().abs().max()))
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -7
    assert float((wide.float() - want.float()).abs().max()) <= tol * scale


@pytest.mark.skipif(DEV == "cpu", reason="bf16: the interpreter truncates its conversions")
@pytest.mark.parametrize("kind", ["plain", "norm+bias", "residual", "gate_up", "head"])
@pytest.mark.parametrize("n,k", [(576, 576), (100, 300), (64, 1536), (7, 4096)])
@pytest.mark.parametrize("m", [1, 3, 31], ids=lambda m: f"{m}rows")
def test_gemv_rounds_where_the_torch_ops_round(m, n, k, kind):
    """bf16, on inputs whose every float32 sum is exact (weights in eighths, inputs in eighths
    or of one magnitude, so that the norm is the weight; norm weights in [0.75, 1.25]): the
    order of the sums cannot matter, so the kernel's result is bit for bit the eager torch
    ops' (`rms_norm`, the projection rounded once after its bias, `h + y`, `F.silu(g) * u`)
    unless a rounding is missing or extra. The projection itself is taken exactly in float32,
    not from cuBLAS: on an H200 cuBLAS's bf16 GEMM of a few rows by a few outputs with a long
    K reduces split-K partials in bf16 (torch's default
    `allow_bf16_reduced_precision_reduction`), and some of its biased shapes round before the
    bias, so its result is not the correctly rounded one there. SiLU's exp may differ from
    torch's in float32's last bit: at least 99 % of its values equal, the rest one bf16 step
    apart."""
    from layersplit.shards.kernels.gemv import gemv

    dt = torch.bfloat16
    g = torch.Generator().manual_seed(n + k + m)
    rows = 2 * n if kind == "gate_up" else n
    normed = kind in ("norm+bias", "head", "gate_up")
    if normed:  # one magnitude: the normalized row is +-1 in bf16, times the norm weight
        x = 0.75 * (torch.randint(0, 2, (m, k), generator=g) * 2 - 1).float()
    else:
        x = torch.randint(-16, 17, (m, k), generator=g) / 8
    x = x.to(DEV, dt)
    w = (torch.randint(-3, 4, (rows, k), generator=g) / 8).to(DEV, dt)
    nw = (0.75 + 0.5 * torch.rand(k, generator=g)).to(DEV, dt) if normed else None
    bias = (torch.randint(-8, 9, (n,), generator=g) / 8).to(DEV, dt) if kind == "norm+bias" \
        else None
    res = torch.randn(m, n, generator=g).to(DEV, dt) if kind == "residual" else None
    got = gemv(x, w, bias=bias, norm=None if nw is None else (nw, 1e-5), residual=res,
               gate_up=kind == "gate_up", out_dtype=torch.float32 if kind == "head" else None)
    xin = rms_norm(x, nw, 1e-5) if normed else x
    want = (xin.double() @ w.double().T + (0 if bias is None else bias.double())).to(dt)
    if kind == "gate_up":
        gg, u = want.chunk(2, dim=-1)
        want = F.silu(gg) * u
    if res is not None:
        want = res + want
    if kind == "head":
        want = want.float()
    if kind != "gate_up":
        assert torch.equal(got, want)
    else:
        same = float((got == want).float().mean())
        step = 2.0 ** -7 * want.float().abs().clamp_min(2.0 ** -20)
        assert same >= 0.99 and bool(((got.float() - want.float()).abs() <= step).all()), same


def test_gemv_refuses_bad_shapes_by_name():
    from layersplit.shards.kernels.gemv import gemv

    x = torch.zeros(1, 64, device=DEV)
    w = torch.zeros(32, 64, device=DEV)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        gemv(torch.zeros(65, 64, device=DEV), w)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        gemv(torch.zeros(2, 128, device=DEV)[:, ::2], w)
    with pytest.raises(ValueError, match="does not take a row of 48"):
        gemv(torch.zeros(1, 48, device=DEV), w)
    with pytest.raises(ValueError, match="even row count and no bias"):
        gemv(x, torch.zeros(31, 64, device=DEV), gate_up=True)
    with pytest.raises(ValueError, match="bias \\(16,\\) is not a contiguous vector of 32"):
        gemv(x, w, bias=torch.zeros(16, device=DEV))
    with pytest.raises(ValueError, match="residual \\(1, 16\\) is not 1 rows of 32"):
        gemv(x, w, residual=torch.zeros(1, 16, device=DEV))
    with pytest.raises(ValueError, match="norm weight \\(63,\\)"):
        gemv(x, w, norm=(torch.ones(63, device=DEV), 1e-5))


def test_one_row_steps_take_the_gemv_kernels_and_match_them_off(tiny_models, monkeypatch):
    """A 6-layer model's graph decode steps with the GEMV kernels (the layers' and the LM
    head's) against the same kernels with the GEMV ones switched off
    (`LAYERSPLIT_GEMV_KERNELS=0`), float32. A failing head kernel then turns only the head's
    off; a failing layer kernel, met while a graph is captured, turns the layers' off (the
    decode kernels stay on) and the row kernels' step is captured instead, with the same
    logits."""
    from layersplit.shards.kernels import GEMV_SWITCH, gemv

    calls = []
    real = gemv.gemv

    def counted(*args, **kwargs):
        calls.append("head" if kwargs.get("head") else "gate_up" if kwargs.get("gate_up")
                     else "other")
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv, "gemv", counted)
    path = tiny_models["qwen2"]  # (q/k/v bias)
    on = _executor(path, "qwen2", torch.float32, True)
    monkeypatch.setenv(GEMV_SWITCH, "0")
    off = _executor(path, "qwen2", torch.float32, True)
    monkeypatch.delenv(GEMV_SWITCH)
    ids = torch.arange(3, 30)
    for ex in (on, off):
        ex.run(ids, 0)
    calls.clear()
    tok = 5

    def same(a, b) -> bool:
        return float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))

    for pos in range(27, 33):
        a, b = on.run(torch.tensor([tok]), pos), off.run(torch.tensor([tok]), pos)
        assert same(a, b), pos
        tok = int(b.argmax())
    fast_on, fast_off = on.model.layers[0].fast, off.model.layers[0].fast
    assert fast_on.gemv is True and fast_off.gemv is False and fast_off.kernels
    # the graphs' captures ran the layers' kernels and the head's
    assert {"head", "gate_up", "other"} <= set(calls), calls

    def broken(*args, **kwargs):
        raise RuntimeError("gemv broken")

    # the head's kernel failing (an eager prefill's last row takes it): the head alone off
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: broken() if k.get("head") else real(*a, **k))
    head_fails = _executor(path, "qwen2", torch.float32, True)
    head_fails.run(ids, 0)
    fast = head_fails.model.layers[0].fast
    assert fast.head_gemv is False and fast.gemv and fast.kernels
    a, b = head_fails.run(torch.tensor([tok]), 27), off.run(torch.tensor([tok]), 27)
    assert same(a, b)
    # every GEMV kernel failing: the first capture meets it in the first layer
    monkeypatch.setattr(gemv, "gemv", broken)
    failing = _executor(path, "qwen2", torch.float32, True)
    failing.run(ids, 0)  # (eager: the row kernels; its head's failure turns the head off)
    fast = failing.model.layers[0].fast
    assert fast.gemv and fast.head_gemv is False
    a = failing.run(torch.tensor([tok]), 27)  # a graph's capture: the layers' kernels fail
    assert fast.gemv is False and fast.kernels
    assert same(a, off.run(torch.tensor([tok]), 27))


class _Calls(list):
    """(rows, head?) of each `gemv.gemv` call; `real`: the function it wraps."""
    real = None


def _recorded_pair(tiny_models, monkeypatch, gemv_rows: str | None):
    """Two float32 executors of the tiny llama with 3 slots, prefilled alike: one with the
    GEMV kernels (`LAYERSPLIT_GEMV_ROWS` = gemv_rows; None: the default), one without; and the
    list that records each `gemv.gemv` call from then on."""
    from layersplit.shards.kernels import GEMV_ROWS, GEMV_SWITCH, gemv

    rows = _Calls()
    rows.real = real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, *a, **k: rows.append(
        (x.shape[0], bool(k.get("head")))) or real(x, *a, **k))
    path = tiny_models["llama"]
    if gemv_rows is None:
        monkeypatch.delenv(GEMV_ROWS, raising=False)
    else:
        monkeypatch.setenv(GEMV_ROWS, gemv_rows)
    on = _executor(path, "llama", torch.float32, True, slots=3)
    monkeypatch.setenv(GEMV_SWITCH, "0")
    off = _executor(path, "llama", torch.float32, True, slots=3)
    ids = torch.arange(3, 40)
    for ex in (on, off):
        for slot in range(3):
            ex.run(ids[:30 + slot], 0, slot)
    return on, off, rows


def test_verify_and_batched_steps_take_the_gemv_kernels_when_asked(tiny_models, monkeypatch):
    """With `LAYERSPLIT_GEMV_ROWS=32` a graph's tree verify step (7 rows) and a batched step
    (slots 0 and 2: a padding row between them) take the few-rows kernel (`_gemm_rows`, tensor
    cores) in their layers and their head, with the logits of the same steps with the GEMV
    kernels off (float32)."""
    on, off, rows = _recorded_pair(tiny_models, monkeypatch, "32")
    assert on.model.layers[0].fast.gemv_rows == 32
    rows.clear()
    outs = [st.run(torch.tensor([5, 7, 9, 11, 4, 6, 8]), 30, 0, [0, 0, 1, 1, 2, 3])[0].clone()
            for st in (on.static, off.static)]
    verify_rows = set(rows)
    rows.clear()
    outs += [st.run_batch(torch.tensor([6, 7]), [0, 2], [37, 32]).clone()
             for st in (on.static, off.static)]
    for a, b in (outs[:2], outs[2:]):
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
    # (the captures ran the few-rows kernel, in the layers as in the head)
    assert {(7, False), (7, True)} <= verify_rows, verify_rows
    assert {r for r, head in rows if not head} == {3} and (3, True) in rows, rows
    fast = on.model.layers[0].fast
    assert fast.gemv and fast.gemv_rows == 32


def test_verify_and_batched_heads_take_the_few_rows_kernel_by_default(tiny_models, monkeypatch):
    """With the default `LAYERSPLIT_GEMV_ROWS` (1) a tree verify step's layers run cuBLAS, but
    its head (and a batched step's) takes the few-rows kernel (`head_rows`: it beat cuBLAS at
    8-32 rows), with the logits of the same steps with the GEMV kernels off (float32); the
    head's failure on several rows sends only those heads back to cuBLAS."""
    from layersplit.shards.kernels import gemv

    on, off, rows = _recorded_pair(tiny_models, monkeypatch, None)
    real = rows.real
    fast = on.model.layers[0].fast
    assert fast.gemv_rows == 1 and fast.head_rows > 7
    rows.clear()
    outs = [st.run(torch.tensor([5, 7, 9, 11, 4, 6, 8]), 30, 0, [0, 0, 1, 1, 2, 3])[0].clone()
            for st in (on.static, off.static)]
    outs += [st.run_batch(torch.tensor([6, 7]), [0, 2], [37, 32]).clone()
             for st in (on.static, off.static)]
    for a, b in (outs[:2], outs[2:]):
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
    assert {r for r, head in rows if not head} == set(), rows  # the layers: cuBLAS
    assert {(7, True), (3, True)} <= set(rows), rows

    def few_rows_broken(x, *a, **k):
        if x.shape[0] > 1:
            raise RuntimeError("few-rows kernel broken")
        return real(x, *a, **k)

    monkeypatch.setattr(gemv, "gemv", few_rows_broken)
    a, b = (ex.static.run(torch.tensor([5, 7, 9, 11]), 33, 0, [0, 0, 1])[0].clone()
            for ex in (on, off))
    assert fast.head_rows == 1 and fast.gemv and fast.head_gemv and fast.kernels
    assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


def test_a_failing_few_rows_kernel_leaves_the_one_row_kernels_on(tiny_models, monkeypatch):
    """The few-rows kernel failing (a verify step's capture) turns steps of several rows back
    to cuBLAS (`gemv_rows` 1); one-row steps keep the GEMV kernels, and the logits are the
    same."""
    from layersplit.shards.kernels import GEMV_ROWS, GEMV_SWITCH, gemv

    real = gemv.gemv

    def few_rows_broken(x, *a, **k):
        if x.shape[0] > 1:
            raise RuntimeError("few-rows kernel broken")
        return real(x, *a, **k)

    path = tiny_models["llama"]
    monkeypatch.setenv(GEMV_ROWS, "32")
    on = _executor(path, "llama", torch.float32, True)
    monkeypatch.setenv(GEMV_SWITCH, "0")
    off = _executor(path, "llama", torch.float32, True)
    ids = torch.arange(3, 30)
    for ex in (on, off):
        ex.run(ids, 0)
    monkeypatch.setattr(gemv, "gemv", few_rows_broken)
    tree = [0, 0, 1]
    a, b = (ex.static.run(torch.tensor([5, 7, 9, 11]), 27, 0, tree)[0].clone()
            for ex in (on, off))
    fast = on.model.layers[0].fast
    assert fast.gemv_rows == 1 and fast.gemv and fast.head_gemv and fast.kernels
    assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
    a, b = (ex.run(torch.tensor([5]), 31) for ex in (on, off))
    assert fast.gemv and float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


def test_a_bad_gemv_rows_setting_is_refused_by_name(monkeypatch):
    from layersplit.shards.fused import FusedDecode
    from layersplit.shards.kernels import GEMV_ROWS

    for bad in ("abc", "0", "65", "-1"):
        monkeypatch.setenv(GEMV_ROWS, bad)
        with pytest.raises(ValueError, match="LAYERSPLIT_GEMV_ROWS="):
            FusedDecode(compile=False)
