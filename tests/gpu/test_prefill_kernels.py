"""Eager steps of dense layers (prefill chunks, long verify steps) through the row kernels
(`FusedDecode.prefill`: `row_ops.rope_qk`, the add + norm and SiLU * up kernels around flash
attention) against the torch layer they replace.

On a CUDA device (`python -m pytest -m gpu`); on a CPU through Triton's interpreter with
`TRITON_INTERPRET=1` (float32 only). Tolerances: `rope_qk` within 4 ulps of each head's
largest value of torch's `apply_rope` (its three roundings are torch's; with a q/k norm the sum
of squares is reduced in another order), and without the norm at least 98 % of the values
equal torch's bit for bit. Whole models: float32 logits within 1e-4 of the torch layers' (per
unit of their largest magnitude); bf16 no further from a float32 run than twice the torch
layers' own distance from it (at least 0.05), as `test_decode_kernels.py`.
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards import fused
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor, Segment
from layersplit.shards.fused import fuse_projections
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.layers.norm import RMSNorm
from layersplit.shards.layers.rotary import apply_rope, base_inv_freq, rope_cos_sin

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("n,nh,ng,d", [(1, 4, 4, 16), (7, 9, 3, 64), (33, 8, 2, 128),
                                        (5, 6, 2, 80)])
def test_rope_qk_matches_torch(n, nh, ng, d, norm, dtype):
    from layersplit.shards.kernels.row_ops import rope_qk

    g = torch.Generator().manual_seed(n * 1000 + nh * 10 + d)
    qkv = (torch.randn(n, (nh + 2 * ng) * d, generator=g) * 2).to(DEV, dtype)
    positions = torch.arange(100, 100 + n, device=DEV)
    cos, sin = rope_cos_sin(base_inv_freq(10000.0, d).to(DEV), positions, dtype)
    q, k, _ = qkv.split([nh * d, ng * d, ng * d], dim=-1)
    q, k = q.reshape(n, nh, d), k.reshape(n, ng, d)
    qn = kn = None
    if norm:
        qn, kn = RMSNorm(d, 1e-6).to(DEV, dtype), RMSNorm(d, 1e-6).to(DEV, dtype)
        with torch.no_grad():
            qn.weight.copy_(1 + 0.2 * torch.randn(d, generator=g))
            kn.weight.copy_(1 + 0.2 * torch.randn(d, generator=g))
        with torch.no_grad():
            q, k = qn(q), kn(k)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = rope_qk(qkv, cos, sin, nh, ng, None if qn is None else qn.weight,
                           None if kn is None else kn.weight, 1e-6)
    assert got_q.shape == (n, nh, d) and got_k.shape == (n, ng, d) and got_q.dtype == dtype
    # each head within a few ulps of its largest value (the rotary's products are rounded as
    # torch rounds them; a normed value may be one ulp apart, carried through the products)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    for got, want in ((got_q, want_q), (got_k, want_k)):
        err = (got.float() - want.float()).abs().amax(-1)
        assert bool((err <= 4 * ulp * want.float().abs().amax(-1)).all())
    if not norm:  # most values equal torch's bit for bit
        same = float((got_q == want_q).float().mean())
        assert same > 0.98, same


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk-norm"])
def test_rope_qk_stores_the_rows_in_the_pool_as_index_copy_does(norm):
    """With `pool`, the kernel's outputs are as without it, and the pool rows of the step hold
    its rotated keys and its values bit for bit, every other row untouched."""
    from layersplit.shards.kernels.row_ops import rope_qk

    n, nh, ng, d, rows = 5, 9, 3, 64, 40
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(n, (nh + 2 * ng) * d, generator=g).to(DEV)
    cos, sin = rope_cos_sin(base_inv_freq(10000.0, d).to(DEV), torch.arange(30, 30 + n,
                                                                             device=DEV),
                            torch.float32)
    w = (1 + 0.2 * torch.randn(2, d, generator=g)).to(DEV) if norm else None
    norms = (w[0], w[1], 1e-6) if norm else (None, None, 0.0)
    k_pool = torch.randn(rows, ng, d, generator=g).to(DEV)
    v_pool = torch.randn(rows, ng, d, generator=g).to(DEV)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    at = torch.tensor([33, 2, 17, 18, 5], device=DEV)
    q0, k0 = rope_qk(qkv, cos, sin, nh, ng, *norms)
    q, k = rope_qk(qkv, cos, sin, nh, ng, *norms, pool=(k_pool, v_pool, at))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    want_k.index_copy_(0, at, k0)
    want_v.index_copy_(0, at, qkv[:, (nh + ng) * d:].reshape(n, ng, d))
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(ValueError, match="pool rows"):
        rope_qk(qkv, cos, sin, nh, ng, pool=(k_pool, v_pool, at[:3]))


def test_rope_qk_refuses_bad_shapes_by_name():
    from layersplit.shards.kernels.row_ops import rope_qk

    cos = sin = torch.zeros(2, 16, device=DEV)
    with pytest.raises(ValueError, match="qkv width 100 is not 4 \\+ 2 x 2 heads"):
        rope_qk(torch.zeros(2, 100, device=DEV), cos, sin, 4, 2)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_qk(torch.zeros(3, 128, device=DEV), cos, sin, 4, 2)
    with pytest.raises(ValueError, match="norm weights"):
        rope_qk(torch.zeros(2, 128, device=DEV), cos, sin, 4, 2, torch.ones(16, device=DEV))


def _executor(path, dtype: torch.dtype, kernels: bool | None, taps: tuple[int, ...] = ()
              ) -> RangeExecutor:
    model = load_layer_range(open_checkpoint(path), 0, 6, dtype, DEV)
    if kernels is not None:
        fuse_projections(model, compile=False, kernels=kernels)
    blocks = 256 // 16
    ex = RangeExecutor(model, 256, 2, device=DEV, static_decode=False, paged=(blocks, 16),
                       taps=taps)
    ex.kv.set_table(0, 0, list(range(blocks // 2)))
    ex.kv.set_table(1, 0, list(range(blocks // 2, blocks)))
    return ex


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral-window", "qwen3_moe",
                                    "qwen2_moe"])
def test_prefill_through_the_row_kernels_matches_the_torch_layers(tiny_models, family, dtype,
                                                                  monkeypatch):
    """A 6-layer model's prompt in three chunks (the first from position 0, the others over
    the cached prefix; past the window on `mistral-window`), every row's logits and the KV
    rows, against the torch layers on the same weights; the kernels ran in every layer."""
    from layersplit.shards.kernels import row_ops

    calls = []
    real = row_ops.rope_qk
    monkeypatch.setattr(row_ops, "rope_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 0)  # (tiny steps: on anyway)
    path = tiny_models[family]
    runs = {"kernels": _executor(path, dtype, True), "torch": _executor(path, dtype, False)}
    if dtype != torch.float32:  # how far bf16 itself takes the torch path
        runs["fp32"] = _executor(path, torch.float32, False)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 60, (90,), generator=g)
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in runs}
    for a, b in ((0, 37), (37, 70), (70, 90)):
        for name, ex in runs.items():
            outs[name].append(ex.run(ids[a:b], a, 1, all_logits=True).float())
    assert len(calls) == 3 * 6  # every layer of every chunk took the kernels
    assert runs["kernels"].model.layers[0].fast.prefill_kernels
    got, want = torch.cat(outs["kernels"]), torch.cat(outs["torch"])
    if "fp32" in outs:  # the kernels as close to float32 as the torch layers are (or closer)
        exact = torch.cat(outs["fp32"])
        assert _rel(got, exact) < max(0.05, 2 * _rel(want, exact))
    else:
        assert _rel(got, want) < 1e-4
    kv_bound = 1e-3 if dtype == torch.float32 else 0.1
    for name in ("k_rows", "v_rows"):
        g_rows = getattr(runs["kernels"].kv, name)
        w_rows = getattr(runs["torch"].kv, name)
        if "fp32" in runs:
            kv_bound = max(0.1, 2 * float((w_rows.float() - getattr(runs["fp32"].kv, name)
                                           .float()).abs().max()))
        assert float((g_rows.float() - w_rows.float()).abs().max()) <= kv_bound, name


def test_a_failing_prefill_kernel_runs_the_torch_layer(tiny_models, monkeypatch):
    """A prefill kernel raising switches the prefill kernels off (not the decode kernels): the
    layer runs in torch, rewriting the same KV rows, with the torch layers' logits."""
    from layersplit.shards.kernels import row_ops

    path = tiny_models["qwen3"]
    runs = {k: _executor(path, torch.float32, on) for k, on in (("kernels", True),
                                                                 ("torch", False))}

    def broken(*args, **kwargs):
        raise RuntimeError("rope kernel broken")

    monkeypatch.setattr(row_ops, "rope_qk", broken)
    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 0)
    ids = torch.arange(3, 40)
    got = runs["kernels"].run(ids, 0, 0, all_logits=True)
    want = runs["torch"].run(ids, 0, 0, all_logits=True)
    fast = runs["kernels"].model.layers[0].fast
    assert fast.prefill_kernels is False and fast.kernels
    assert _rel(got, want) < 1e-4


def test_small_eager_steps_run_the_torch_layer(tiny_models, monkeypatch):
    """Below `PREFILL_KERNELS_MIN_ELEMENTS` (rows x hidden) an eager step runs the torch layer
    (the kernels' launches would cost the host more than they save the GPU); at it, the
    kernels."""
    from layersplit.shards.kernels import row_ops

    calls = []
    real = row_ops.rope_qk
    monkeypatch.setattr(row_ops, "rope_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    ex = _executor(tiny_models["llama"], torch.float32, True)
    hidden = ex.model.cfg.hidden_size
    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 20 * hidden)
    ex.run(torch.arange(3, 22), 0, 0)  # 19 rows
    assert calls == []
    ex.run(torch.arange(3, 23), 19, 0)  # 20 rows
    assert len(calls) == 6


def test_warm_prefill_launches_the_kernel_once_and_a_failure_turns_it_off(tiny_models,
                                                                         monkeypatch):
    """At start (`warm_prefill`, a shard's `warm`) the eager steps' kernels run once on
    zeros with the range's head shapes and q/k norms, and the row kernels around the
    projections (which captured one-row steps no longer launch); if one raises, eager steps
    run the torch layers from then on (before any request)."""
    from layersplit.shards.kernels import row_ops

    seen, rows = [], []
    real = row_ops.rope_qk
    monkeypatch.setattr(row_ops, "rope_qk",
                        lambda qkv, *a, **k: seen.append((qkv.shape, a[2:4], a[4] is not None,
                                                          len(a) > 7 and a[7] is not None))
                        or real(qkv, *a, **k))
    for name in ("rms_norm_rows", "add_rms_norm", "silu_mul"):
        monkeypatch.setattr(row_ops, name, lambda *a, _f=getattr(row_ops, name), _n=name, **k:
                            rows.append((_n, tuple(a[0].shape), len(a) > 2 and a[2] is not None))
                            or _f(*a, **k))
    ex = _executor(tiny_models["qwen3"], torch.float32, True)
    layer = ex.model.layers[0]
    fused.warm_prefill(ex.model)
    a = layer.self_attn
    # (both of its variants: the one that stores K/V rows in a paged pool too)
    assert seen == [((2, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim),
                     (a.num_heads, a.num_kv_heads), True, pool) for pool in (False, True)]
    hidden, ff2 = layer.input_layernorm.weight.shape[0], layer.mlp.gate_up_proj.weight.shape[0]
    assert rows == [("rms_norm_rows", (2, hidden), True), ("add_rms_norm", (2, hidden), True),
                    ("add_rms_norm", (2, hidden), False), ("silu_mul", (2, ff2), False)]
    assert layer.fast.prefill_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(row_ops, "rope_qk", broken)
    fused.warm_prefill(ex.model)
    assert layer.fast.prefill_kernels is False


@pytest.mark.parametrize("family", ["qwen3", "mistral-window", "qwen3_moe"])
def test_several_sequences_prefill_in_one_step_as_each_alone(tiny_models, family, monkeypatch):
    """Two sequences' prefill chunks in one step (`run_segments`: one forward over their rows,
    attention and KV rows sequence by sequence): the first chunks from position 0, then the
    second chunks over each one's cached prefix (past the window on `mistral-window`), with
    every row's logits for one, the last row's for the other, and tapped rows; against each
    chunk run alone. float32, within 1e-5 (a GEMM over more rows may round a row otherwise)."""
    from layersplit.shards.kernels import row_ops

    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 0)
    calls = []
    real = row_ops.rope_qk
    monkeypatch.setattr(row_ops, "rope_qk", lambda *a, **k: calls.append(a[0].shape[0]) or
                        real(*a, **k))
    path = tiny_models[family]
    batched, alone = (_executor(path, torch.float32, True, taps=(1, 4)) for _ in range(2))
    batched.batch_prefill = True  # (a GPU's default; on the CPU it is off)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 60, (70,), generator=g), torch.randint(3, 60, (50,), generator=g)]
    for (a0, b0), (a1, b1) in (((0, 23), (0, 31)), ((23, 70), (31, 50))):
        segs = [Segment(0, a0, b0 - a0, taps={}), Segment(1, a1, b1 - a1, all_logits=True)]
        calls.clear()
        outs = batched.run_segments(torch.cat([ids[0][a0:b0], ids[1][a1:b1]]), segs)
        assert calls == [b0 - a0 + b1 - a1] * 6  # one forward over both chunks' rows
        want_taps: dict[int, torch.Tensor] = {}
        want = [alone.run(ids[0][a0:b0], a0, 0, taps=want_taps),
                alone.run(ids[1][a1:b1], a1, 1, all_logits=True)]
        vocab = batched.model.cfg.vocab_size
        assert [o.shape for o in outs] == [w.shape for w in want] == [(1, vocab),
                                                                      (b1 - a1, vocab)]
        for got, exp in zip(outs, want):
            assert _rel(got, exp) < 1e-5
        assert sorted(segs[0].taps) == [1, 4]
        for layer, rows in want_taps.items():
            assert _rel(segs[0].taps[layer], rows) < 1e-5
    assert batched.batch_prefill
    for name in ("k_rows", "v_rows"):
        assert _rel(getattr(batched.kv, name), getattr(alone.kv, name)) < 1e-5


def test_a_refused_batched_prefill_runs_each_sequence_alone(tiny_models, monkeypatch):
    """A prefill kernel failing inside a batched prefill step: the layer refuses the step, the
    segments run alone (the torch layers, rewriting the same KV rows) with the torch layers'
    logits, and later steps run them alone."""
    from layersplit.shards.kernels import row_ops

    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 0)
    path = tiny_models["llama"]
    batched, torch_path = _executor(path, torch.float32, True), _executor(path, torch.float32,
                                                                         False)
    batched.batch_prefill = True

    def broken(*args, **kwargs):
        raise RuntimeError("rope kernel broken")

    monkeypatch.setattr(row_ops, "rope_qk", broken)
    ids = torch.arange(3, 50)
    outs = batched.run_segments(ids, [Segment(0, 0, 20), Segment(1, 0, 27)])
    want = [torch_path.run(ids[:20], 0, 0), torch_path.run(ids[20:], 0, 1)]
    assert batched.batch_prefill is False
    for got, exp in zip(outs, want):
        assert _rel(got, exp) < 1e-4
    for name in ("k_rows", "v_rows"):
        assert _rel(getattr(batched.kv, name), getattr(torch_path.kv, name)) < 1e-4


def test_a_batch_under_the_kernels_threshold_runs_alone_and_batching_stays_on(tiny_models,
                                                                                monkeypatch):
    """Chunks whose rows together stay under `PREFILL_KERNELS_MIN_ELEMENTS` run alone (the
    torch layers), and a later step over it runs batched."""
    from layersplit.shards.kernels import row_ops

    calls = []
    real = row_ops.rope_qk
    monkeypatch.setattr(row_ops, "rope_qk", lambda *a, **k: calls.append(a[0].shape[0]) or
                        real(*a, **k))
    ex = _executor(tiny_models["llama"], torch.float32, True)
    ex.batch_prefill = True
    monkeypatch.setattr(fused, "PREFILL_KERNELS_MIN_ELEMENTS", 20 * ex.model.cfg.hidden_size)
    ex.run_segments(torch.arange(3, 19), [Segment(0, 0, 8), Segment(1, 0, 8)])
    assert calls == [] and ex.batch_prefill
    ex.run_segments(torch.arange(3, 27), [Segment(0, 8, 12), Segment(1, 8, 12)])
    assert calls == [24] * 6 and ex.batch_prefill
