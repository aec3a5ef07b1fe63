"""Eager prefill steps as piecewise CUDA graphs (`shards.prefill_graphs`) against the row kernels'
eager layers (`FusedDecode.prefill`) on the same weights: every row's logits, the tapped rows
and the KV rows, chunk after chunk over a cached prefix, steps of several buckets; a range the
pieces do not serve is refused by name.

On a CUDA device (`python -m pytest -m gpu`): the pieces captured and replayed; on a CPU
through Triton's interpreter with `TRITON_INTERPRET=1` (float32; the pieces called, not
captured). Tolerances as `test_prefill_kernels.py`: float32 within 1e-4 of the eager layers'
largest magnitude (a GEMM over a bucket's padded rows may round a row otherwise); bf16 no further
from a float32 run than twice the eager layers' own distance from it (at least 0.05).
"""

from __future__ import annotations

import pytest
import torch
from layersplit.shards import prefill_graphs
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.fused import FusedDecode, fuse_projections
from layersplit.shards.kernels import fused_kernels_available
from layersplit.shards.prefill_graphs import PrefillGraphs, refusal

from tests.gpu import test_decode_kernels  # noqa: F401 - its interpreter patch (TRITON_INTERPRET)

DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fused_kernels_available(DEV),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1) and Triton")]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV != "cpu" else [])
BLOCKS = 32  # of 16 rows: slot 0 the first 8, slot 1 the other 24


def _executor(path, dtype: torch.dtype, graphs: bool, start: int = 0, end: int = 6,
              taps: tuple[int, ...] = ()) -> RangeExecutor:
    model = load_layer_range(open_checkpoint(path), start, end, dtype, DEV)
    fuse_projections(model, compile=False, kernels=True)
    ex = RangeExecutor(model, 384, 2, device=DEV, static_decode=False, paged=(BLOCKS, 16),
                       taps=taps)
    ex.kv.set_table(0, 0, list(range(8)))
    ex.kv.set_table(1, 0, list(range(8, BLOCKS)))
    if graphs:
        assert refusal(model, ex.kv) is None
        ex.prefill_graphs = PrefillGraphs(model, ex.kv, 256)
    return ex


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


# chunks of 37, 33 (a bucket of 64), 20 (32), 1 (16) and 150 rows (256) over their prefix
CHUNKS = ((0, 37), (37, 70), (70, 90), (90, 91), (91, 241))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pieces_equal_the_eager_layers(tiny_models, family, dtype, monkeypatch):
    """A 6-layer model's prompt in chunks of several buckets, the first from position 0 and
    the rest over the cached prefix: every row's logits, the tapped rows (the last layer's
    normed) and slot 1's KV rows against the eager layers'; slot 0's rows untouched; no eager
    layer ran."""
    eager_calls = []
    real = FusedDecode.prefill
    monkeypatch.setattr(FusedDecode, "prefill",
                        lambda *a, **k: eager_calls.append(1) or real(*a, **k))
    path = tiny_models[family]
    taps = (1, 5)
    runs = {"graphs": _executor(path, dtype, True, taps=taps),
            "eager": _executor(path, dtype, False, taps=taps)}
    if dtype != torch.float32:
        runs["fp32"] = _executor(path, torch.float32, False, taps=taps)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 60, (CHUNKS[-1][1],), generator=g)
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in runs}
    tapped: dict[str, list[torch.Tensor]] = {k: [] for k in runs}
    for a, b in CHUNKS:
        for name, ex in runs.items():
            rows: dict = {}
            outs[name].append(ex.run(ids[a:b], a, 1, all_logits=True, taps=rows).float())
            tapped[name].append(torch.cat([rows[t].float() for t in taps], dim=1))
            if name == "graphs":
                assert not eager_calls, "an eager layer ran a step the pieces take"
            eager_calls.clear()
    assert sorted(runs["graphs"].prefill_graphs.sets) == [16, 32, 64, 256]
    for got_name in ("logits", "taps"):
        src = outs if got_name == "logits" else tapped
        got, want = torch.cat(src["graphs"]), torch.cat(src["eager"])
        if "fp32" in src:
            exact = torch.cat(src["fp32"])
            assert _rel(got, exact) < max(0.05, 2 * _rel(want, exact)), got_name
        else:
            assert _rel(got, want) < 1e-4, got_name
    kv_g, kv_e = runs["graphs"].kv, runs["eager"].kv
    real_rows = kv_g.num_blocks * kv_g.block  # (the scratch block's rows after them)
    for name in ("k_rows", "v_rows"):
        got, want = getattr(kv_g, name)[:, :real_rows], getattr(kv_e, name)[:, :real_rows]
        bound = 1e-4 if dtype == torch.float32 else 0.1
        assert float((got.float() - want.float()).abs().max()) <= bound, name
        assert not bool(got[:, :8 * 16].any()), f"slot 0's {name} written"


def _no_eager_layer(monkeypatch) -> list:
    """FusedDecode.prefill's calls, counted (the eager layers' path)."""
    calls: list = []
    real = FusedDecode.prefill
    monkeypatch.setattr(FusedDecode, "prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_middle_range_takes_and_gives_hidden_rows(tiny_models, monkeypatch):
    """A range that is neither first nor last: hidden rows in, hidden rows out, as the eager
    layers' (the second shard of three)."""
    path = tiny_models["llama"]
    runs = [_executor(path, torch.float32, graphs, start=2, end=4) for graphs in (True, False)]
    g = torch.Generator().manual_seed(3)
    hidden = runs[0].model.cfg.hidden_size
    eager = _no_eager_layer(monkeypatch)
    for a, b in ((0, 40), (40, 47)):
        x = torch.randn(b - a, hidden, generator=g).to(DEV)
        got = runs[0].run(x, a, 0)
        assert not eager
        want = runs[1].run(x, a, 0)
        eager.clear()
        assert got.shape == want.shape == (b - a, hidden)
        assert _rel(got, want) < 1e-4
    assert sorted(runs[0].prefill_graphs.sets) == [16, 64]


def test_ranges_the_pieces_do_not_serve_are_refused_by_name(tiny_models, monkeypatch):
    """Sparse layers, sliding windows, a contiguous KV cache, a hidden size over the cap and
    the switch: each refused, saying why."""
    def refused(family: str, paged: bool = True) -> str | None:
        model = load_layer_range(open_checkpoint(tiny_models[family]), 0, 6, torch.float32, DEV)
        fuse_projections(model, compile=False, kernels=True)
        ex = RangeExecutor(model, 384, 1, device=DEV, static_decode=False,
                           paged=(BLOCKS, 16) if paged else None)
        return refusal(model, ex.kv)

    assert "is not a dense" in refused("qwen3_moe")
    assert "not a dense" in refused("mistral-window")
    assert refused("llama", paged=False) == "no paged KV pool"
    assert refused("llama") is None
    monkeypatch.setattr(prefill_graphs, "MAX_HIDDEN", 8)
    assert "hidden size" in refused("llama")
    monkeypatch.setattr(prefill_graphs, "MAX_HIDDEN", 1024)
    monkeypatch.setenv(prefill_graphs.SWITCH, "0")
    assert refused("llama") == f"{prefill_graphs.SWITCH}=0"


def test_a_step_larger_than_every_bucket_runs_the_eager_layers(tiny_models):
    """More rows than the largest bucket: the eager layers run the step (no bucket built)."""
    ex = _executor(tiny_models["llama"], torch.float32, True)
    ex.prefill_graphs.buckets = [16, 32]
    ids = torch.arange(3, 43)
    want = _executor(tiny_models["llama"], torch.float32, False).run(ids, 0, 1)
    got = ex.run(ids, 0, 1)
    assert not ex.prefill_graphs.sets
    assert _rel(got, want) == 0.0


def test_warm_builds_the_buckets_up_to_the_largest_step(tiny_models, monkeypatch):
    """`warm` (a shard's, before any request) builds each bucket up to the first that holds
    `max_rows`; a later step takes its bucket as built."""
    ex = _executor(tiny_models["llama"], torch.float32, True)
    built, _ = ex.prefill_graphs.warm(100)
    assert built == 4 and sorted(ex.prefill_graphs.sets) == [16, 32, 64, 128]
    b = ex.prefill_graphs.sets[64]
    want = _executor(tiny_models["llama"], torch.float32, False).run(torch.arange(3, 43), 0, 1)
    eager = _no_eager_layer(monkeypatch)
    assert _rel(ex.run(torch.arange(3, 43), 0, 1), want) < 1e-4
    assert not eager
    assert ex.prefill_graphs.sets[64] is b and ex.prefill_graphs.warm(100)[0] == 0


def test_a_bucket_that_fails_to_build_turns_the_pieces_off(tiny_models, monkeypatch, caplog):
    """A failure building a bucket (a capture's, a kernel's) is logged, the step runs the
    eager layers, and so does every later one; the buckets built before are given back."""
    ex = _executor(tiny_models["llama"], torch.float32, True)
    ex.run(torch.arange(3, 8), 0, 1)  # (bucket 16 built)
    assert list(ex.prefill_graphs.sets) == [16]

    def broken(r):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(ex.prefill_graphs, "_build", broken)
    want = _executor(tiny_models["llama"], torch.float32, False).run(torch.arange(3, 43), 0, 1)
    assert _rel(ex.run(torch.arange(3, 43), 0, 1), want) == 0.0
    assert not ex.prefill_graphs.on and not ex.prefill_graphs.takes(8)
    assert not ex.prefill_graphs.sets  # (the built buckets given back)
    assert "prefill graphs of 64 rows failed (RuntimeError: capture failed)" in caplog.text


def test_padding_rows_start_from_zero_each_step(tiny_models):
    """Many one-row steps in one bucket after a longer one: the padding rows are a pass from
    zero each time (the same values at the 3rd step and the 25th, not the longer step's rows
    run through the range again and again), and the scratch row they store their K/V in stays
    finite."""
    ex = _executor(tiny_models["llama"], torch.float32, True)
    ex.run(torch.arange(3, 43), 0, 1)  # (a prefix: bucket 64)
    ex.run(torch.arange(3, 15), 40, 1)  # 12 rows in bucket 16: real rows in its rows 1-11
    pieces = ex.prefill_graphs
    seen = {}
    for i in range(25):
        ex.run(torch.tensor([5 + i % 7]), 52 + i, 1)
        if i in (2, 24):
            seen[i] = pieces.sets[16].h[1:].clone()
    assert torch.equal(seen[2], seen[24])
    scratch = pieces.scratch
    for rows in (ex.kv.k_rows, ex.kv.v_rows):
        assert bool(rows[:, scratch].isfinite().all())
