"""Failing tests of hybrid fused-step and warm-capture hazards (CPU stand-ins)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor

pytest.importorskip("transformers")


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_non_compile_failure_in_the_fused_step_keeps_the_compiled_stages(hybrid_models,
                                                                           monkeypatch):
    """A delta-rule kernel re-raising inside a capture (`_guarded`) is no torch.compile failure:
    the fused hybrid step should not drop its compiled stages for the whole process."""
    import layersplit.shards.fused_hybrid as fh

    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=False)
    ex.run(_ids(5), 0, 0)
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
        ex.run(_ids(1), 5, 0)
    assert fast.compiled, "a capture-time kernel failure turned torch.compile off"


def test_a_failed_verify_capture_at_warm_leaves_chain_verify_eager(hybrid_models, monkeypatch):
    """Before warm captured them, a failed hybrid verify capture left chain verify steps eager
    (`RangeExecutor._hybrid_chain_graph`); at warm the same failure should not fail the start."""
    import layersplit.shards.graphs as graphs

    ckpt = open_checkpoint(hybrid_models["qwen3_5"])
    ex = RangeExecutor(load_layer_range(ckpt, 0, 6), 64, 2, static_decode=True, graph_bucket=4,
                       paged=(64, 8))
    ex.static.capture = True
    ex.hybrid_chain_verify = True

    class _G:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            self.fn()

    def capture(fn, pool):
        out = fn()
        if out[0].shape[0] > 1:  # (the verify graphs: the one-row ones capture)
            raise RuntimeError("capture failed (a kernel that is not capturable)")
        return _G(fn, out), out

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ex.static.warm((1, 3), 0)  # raises: the start fails
    assert ex.static.graphs and not ex.static.verify_graphs
