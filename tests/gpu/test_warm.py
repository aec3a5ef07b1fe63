"""`StaticDecoder.warm` on a GPU (`capture_at_start`): after it, decode steps at every KV-length
bucket, verify steps of the warmed row counts and batched steps replay graphs it captured (no
capture inside a request), and their outputs equal those of an executor that captures each graph
on first use, bit for bit: the captures' runs left nothing a step reads (a hybrid range's
recurrent states are put back)."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor, Segment
from layersplit.shards.fused import fuse_projections

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_LEN, BLOCK, SLOTS = 320, 16, 3  # 20 blocks a slot


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo compiles a function for at most 8 shapes and dtypes per process: the shapes
    these tests compile must not crowd out a later test's (one shard has one dtype)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _executor(path) -> RangeExecutor:
    model = load_layer_range(open_checkpoint(path), 0, 6, torch.bfloat16, "cuda:0")
    fuse_projections(model, compile=True)
    ex = RangeExecutor(model, MAX_LEN, SLOTS, "cuda:0", static_decode=True, graph_bucket=32,
                       paged=(SLOTS * MAX_LEN // BLOCK, BLOCK))
    for slot in range(SLOTS):  # slot s holds blocks s, s + 3, s + 6, ...
        ex.kv.set_table(slot, 0, list(range(slot, SLOTS * MAX_LEN // BLOCK, SLOTS)))
    return ex


def _steps(ex: RangeExecutor, hybrid: bool) -> list[torch.Tensor]:
    """Prefill each slot, then decode steps up to past the first two buckets, a verify step of
    4 rows (a hybrid range's: a chain's, all 4 kept), batched steps of all three slots and
    batched verify steps of two (dense)."""
    dev = "cuda:0"
    outs = []
    for slot in range(SLOTS):
        outs.append(ex.run(torch.arange(3, 23 + slot, device=dev), 0, slot).clone())
    for pos in range(20, 70):
        outs.append(ex.run(torch.tensor([pos % 50 + 5], device=dev), pos, 0).clone())
    outs.append(ex.run(torch.tensor([4, 9, 8, 7], device=dev), 70, 0, all_logits=True,
                       verify=True).clone())
    ex.before_step(0, 74, None)  # (a hybrid range settles on the chain's last row)
    for pos in range(74, 80):
        x = torch.tensor([pos % 40 + 3, 11, 12], device=dev)
        segs = [Segment(0, pos, 1), Segment(1, pos - 53, 1), Segment(2, pos - 52, 1)]
        outs += [o.clone() for o in ex.run_segments(x, segs)]
    if not hybrid:
        for pos in (30, 34):  # two sequences' verify steps as one batched step
            x = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12], device=dev)
            segs = [Segment(1, pos, 4, verify=True, all_logits=True),
                    Segment(2, pos + 1, 4, verify=True, tree=[0, 0, 1], all_logits=True)]
            outs += [o.clone() for o in ex.run_segments(x, segs)]
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_warmed_steps_capture_nothing_and_equal_first_use(tiny_llama, hybrid_models, family):
    path = tiny_llama if family == "llama" else hybrid_models["qwen3_5"]
    hybrid = family != "llama"
    cold, warm = _executor(path), _executor(path)
    graphs, seconds = warm.static.warm((1, 4), SLOTS, verify_batch=SLOTS)
    buckets = warm.static.buckets
    # dense: rows 1 and 4; batches of 2 and 4; batched verify steps of 2 and 4 sequences of 4
    # rows. hybrid: one row in each slot, a chain of 4 rows in any slot, batches of 2 and 4
    want = len(buckets) * (SLOTS + 3 if hybrid else 6)
    assert graphs == want and seconds > 0
    assert warm.static.warm((1, 4), SLOTS, verify_batch=SLOTS)[0] == 0  # all there already
    static = warm.static

    def held() -> tuple[set, ...]:  # (sets: a replayed graph moves to its dict's end, LRU)
        return tuple(set(g) for g in (static.graphs, static.batch_graphs, static.vbatch_graphs,
                                      static.verify_graphs))

    before = held()
    got, ref = _steps(warm, hybrid), _steps(cold, hybrid)
    assert held() == before
    if hybrid:  # (the chain verify and the batched steps ran as graphs, not eager)
        assert cold.static.verify_graphs and cold.static.batch_graphs
        assert warm.hybrid_verify_graphs and warm.batch_decode
    else:  # (the batched verify steps ran as such)
        assert cold.static.vbatch_graphs
    assert len(cold.static.graphs) > 0
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
