"""A hybrid range's captured batched decode and chain verify graphs at start and when they fail,
with a CPU stand-in for the capture (`tests.helpers.cpu_capture`); their answers against the
eager steps are in `tests/shards/test_hybrid_model.py`."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor

from tests.helpers import cpu_capture, token_ids

pytest.importorskip("transformers")



@pytest.fixture
def captured(monkeypatch):
    import layersplit.shards.graphs as graphs

    monkeypatch.setattr(graphs, "capture", cpu_capture)


def test_warm_plans_no_batch_graph_whose_experts_would_sync_the_host(hybrid_models):
    """`warm` captures the planned batched steps at start; over a mixture of experts that
    would sync the host at that batch (`HybridRange.graph_safe`: no grouped GEMM for the
    dtype, more rows x experts than gather), the capture would fail, so it must not be
    planned (the executor itself never runs such a batch: `run_segments`)."""
    from layersplit.shards.graphs import StaticDecoder

    ckpt = open_checkpoint(hybrid_models["qwen3_5_moe"])
    model = load_layer_range(ckpt, 0, 6)  # (float32: no grouped GEMM on a GPU)
    kv = model.new_cache(96, 64, "cpu", torch.float32, paged=(256, 8))
    static = StaticDecoder(model, kv, 4, per_slot=True)
    plan, _ = static.warm_plan((1,), 64)
    unsafe = [item for item in plan if item[0] == "batch" and not model.graph_safe(item[2])]
    assert not unsafe, f"warm would capture {len(unsafe)} batched steps that sync the host"


def test_a_failure_after_the_batched_replay_does_not_run_the_rows_again(hybrid_models):
    """A failure of a hybrid batched step after its replay (an allocation failing in
    `out[order]` or the taps' gather) is raised: every row's states advanced already, so
    running the rows alone (as after a failed capture) would advance them twice; batched
    steps stay on."""
    from layersplit.shards.executor import Segment

    ex = _two_slots(hybrid_models)
    inner = ex.static.run_batch

    def fails_after(*a, **k):
        inner(*a, **k)
        raise torch.OutOfMemoryError("CUDA out of memory (allocating the output rows)")

    ex.static.run_batch = fails_after
    with pytest.raises(torch.OutOfMemoryError):
        ex._run_batch(torch.tensor([3, 4]), [Segment(0, 7, 1), Segment(1, 7, 1)], None)
    assert ex.batch_decode


def test_a_failed_batched_capture_runs_the_rows_alone(hybrid_models, monkeypatch, caplog):
    """A hybrid batched graph whose capture fails (a host sync in it, say) is logged and
    answered by None, its rows' states as they were (its warm-up runs advanced only the
    scratch slot's), and batched decode steps are off from then on."""
    import layersplit.shards.graphs as graphs
    from layersplit.shards.executor import Segment

    ex = _two_slots(hybrid_models)
    ex.static.capture = True

    def failing(fn, pool):
        fn()  # (a warm-up run, then the capture fails)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture", failing)
    before = [ex.kv.save(s) for s in range(2)]
    with caplog.at_level("WARNING", logger="layersplit.shards.executor"):
        out = ex._run_batch(torch.tensor([3, 4]), [Segment(0, 7, 1), Segment(1, 7, 1)], None)
    assert out is None and not ex.batch_decode
    assert "a hybrid batched decode graph failed to capture (RuntimeError: operation not" in \
        caplog.text
    for s in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ex.kv.save(s), before[s]))


def _two_slots(hybrid_models) -> RangeExecutor:
    """A captured (static) paged executor of the tiny Qwen3.5 with two prompts of 7 tokens."""
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 96, 2, static_decode=True, graph_bucket=4,
                       paged=(64, 8))
    for slot in range(2):
        ex.kv.set_table(slot, 0, list(range(slot, 24, 2)))
        ex.run(token_ids(7, seed=slot), 0, slot)
    return ex


def test_warm_captures_verify_and_batched_graphs_and_leaves_every_slot(hybrid_models, captured,
                                                                     monkeypatch):
    """`warm` (the shard's captures at start) takes a hybrid paged range's chain verify graphs
    (one a bucket and rows, the keep pair of the longest made first) and its batched graphs,
    advancing no slot's states; the verify steps after it replay them, capturing nothing."""
    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    one, rows = (RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=st,
                               graph_bucket=4, paged=(64, 8)) for st in (True, False))
    one.static.capture = True
    one.hybrid_chain_verify = True
    for ex in (one, rows):
        ex.kv.set_table(0, 0, list(range(0, 16, 2)))
        ex.kv.set_table(1, 0, list(range(15, 0, -2)))
        for slot in range(2):
            ex.run(token_ids(9, seed=slot), 0, slot)
    before = [one.kv.save(s) for s in range(2)]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # (no device here)
    graphs, _ = one.static.warm((1, 3, 5), 2)
    verify = set(one.static.verify_graphs)
    assert {(k[0], k[2]) for k in verify} == {(-1, 3), (-1, 5)}
    assert one.static.batch_graphs and one.static.keep[1].shape[1] == 5
    assert graphs == len(verify) + len(one.static.graphs) + len(one.static.batch_graphs)
    for s in range(2):
        assert all(torch.equal(a, b) for a, b in zip(one.kv.save(s), before[s]))
    for slot, m in ((0, 5), (1, 3)):
        chain = torch.tensor([4, 8, 15, 16, 23])[:m]
        a = one.run(chain, 9, slot, all_logits=True, verify=True).clone()
        b = rows.run(chain, 9, slot, all_logits=True, verify=True)
        assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
    assert set(one.static.verify_graphs) == verify  # (nothing captured after the start)


def test_a_non_compile_failure_in_the_fused_step_keeps_the_compiled_stages(hybrid_models,
                                                                           monkeypatch):
    """A kernel failing inside the fused hybrid step (a delta-rule kernel re-raising inside a
    capture, `guarded`) is no torch.compile failure: the step raises and keeps its compiled
    stages for the process's other steps."""
    import layersplit.shards.fused_hybrid as fh

    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=False)
    ex.run(token_ids(5), 0, 0)
    fast = fh.HybridFast(compile=False)
    fast.compiled = True  # (stands for compiled stages; eager ones keep the test fast)
    for layer in ex.model.layers:
        (layer.linear_attn if layer.linear else layer.self_attn).fuse()
        layer.mlp.fuse()
        layer.fast = fast

    def failing_rule(*a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fh, "pick_rule", lambda *a: failing_rule)
    with pytest.raises(RuntimeError):
        ex.run(token_ids(1), 5, 0)
    assert fast.compiled, "a capture-time kernel failure turned torch.compile off"


def test_a_failed_verify_capture_at_warm_leaves_chain_verify_eager(hybrid_models, monkeypatch):
    """A hybrid verify graph that fails to capture at start (`warm`) is logged, not raised
    (the start goes on), and chain verify steps then run the eager one-step path, right."""
    import layersplit.shards.graphs as graphs

    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=True, graph_bucket=4,
                       paged=(64, 8))
    ex.static.capture = True
    ex.hybrid_chain_verify = True

    def capture(fn, pool):
        if fn()[0].shape[0] > 1:  # (the verify graphs: the one-row ones capture)
            raise RuntimeError("capture failed (a kernel that is not capturable)")
        return cpu_capture(fn, pool)

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ex.static.warm((1, 3), 0)
    assert ex.static.graphs and not ex.static.verify_graphs and ex.static.failed == {"verify"}
    ref = RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=False, paged=(64, 8))
    for e in (ex, ref):
        e.kv.set_table(0, 0, list(range(0, 16, 2)))
        e.run(token_ids(6), 0, 0)
    calls = []
    inner = ex._hybrid_chain
    ex._hybrid_chain = lambda *a: calls.append(a[2]) or inner(*a)
    chain = torch.tensor([4, 8, 15])
    a = ex.run(chain, 6, 0, all_logits=True, verify=True)
    b = ref.run(chain, 6, 0, all_logits=True, verify=True)
    assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item() and calls == [0]
