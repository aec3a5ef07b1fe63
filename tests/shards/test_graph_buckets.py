"""KV-length buckets of captured step graphs (`shards.graphs.kv_buckets`): every length up to
the context has one, linear up to 16 buckets, then 8 per doubling, so a step attends at most
1/8 more keys than it has and a 128K context takes 56 graphs of a kind."""

from __future__ import annotations

import pytest
import torch
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint
from layersplit.shards.executor import RangeExecutor
from layersplit.shards.graphs import kv_buckets


@pytest.mark.parametrize("bucket", [1, 3, 16, 256, 1024])
@pytest.mark.parametrize("max_len", [1, 2, 100, 4096, 5000, 131072, 200_001])
def test_buckets_cover_every_length_with_bounded_waste(bucket, max_len):
    b = kv_buckets(bucket, max_len)
    assert b == sorted(set(b)) and b[-1] == max_len and b[0] >= 1
    for lo, hi in zip([0, *b], b):
        gap = hi - lo
        assert gap <= bucket or gap <= lo // 8, (lo, hi)  # (lo + 1 keys at least, each time)
    assert all(x % bucket == 0 for x in b[:-1])


def test_bucket_counts():
    assert kv_buckets(256, 4096) == [256 * i for i in range(1, 17)]
    assert len(kv_buckets(256, 131072)) == 56
    assert kv_buckets(256, 131072)[16:19] == [4608, 5120, 5632]
    assert kv_buckets(256, 100) == [100]
    assert len(kv_buckets(1024, 32768)) == 24


def test_a_step_takes_the_smallest_bucket_that_holds_it(tiny_llama):
    ex = RangeExecutor(load_layer_range(open_checkpoint(tiny_llama), 0, 6), 9000, 1,
                       static_decode=True, graph_bucket=256)
    static = ex.static
    assert static.kv_len(0) == 256 and static.kv_len(255) == 256 and static.kv_len(256) == 512
    assert static.kv_len(4095) == 4096 and static.kv_len(4096) == 4608
    assert static.kv_len(8191, 1) == 8192 and static.kv_len(8192) == 9000
    assert static.kv_len(8000, 5) == 8192
    assert static.warm((1, 4), 8) == (0, 0.0)  # on the CPU nothing is captured


def test_the_warm_plan_and_its_caps(tiny_llama, monkeypatch):
    """What `warm` captures: one-row and verify steps and batched steps up to the batch's
    bucket over a paged cache, for every bucket, shortest first; capped by graphs and by the
    output rows they hold (the rest on first use)."""
    from layersplit.shards import graphs

    model = load_layer_range(open_checkpoint(tiny_llama), 0, 6)
    ex = RangeExecutor(model, 1024, 4, static_decode=True, graph_bucket=256, paged=(256, 16))
    plan, wanted = ex.static.warm_plan((1, 4, 4), 3)
    assert wanted == len(plan) == 4 * (2 + 2)  # rows 1 and 4; batches of 2 and 4
    assert plan[:4] == [("step", -1, 1, 256), ("step", -1, 4, 256), ("batch", 0, 2, 256),
                        ("batch", 0, 4, 256)]
    assert [p[3] for p in plan] == sorted(p[3] for p in plan)
    assert ex.static.warm_plan((1,), 1)[0] == [("step", -1, 1, t) for t in (256, 512, 768, 1024)]
    monkeypatch.setattr(graphs, "WARM_GRAPHS", 5)
    assert ex.static.warm_plan((1, 4), 3) == (plan[:5], 16)
    monkeypatch.setattr(graphs, "WARM_GRAPHS", 1024)
    row = model.cfg.vocab_size * 4  # float32 logits a row, on the last range
    monkeypatch.setattr(graphs, "WARM_OUTPUT_BYTES", (1 + 4 + 2 + 4) * row)
    assert ex.static.warm_plan((1, 4), 3)[0] == plan[:4]


def test_graphs_past_their_budget_go_least_recently_used_first():
    """`keep_recent` (the batched verify graphs of a shard, the draft's batched proposal
    graphs): the entry just used is kept whatever its size; older ones go, least recently used
    first, until the rest fits the budget."""
    from layersplit.shards.graphs import keep_recent

    graphs: dict = {}
    for key, size in (("a", 4), ("b", 3), ("c", 2)):
        keep_recent(graphs, key, size, 10, lambda e: e)
    assert list(graphs) == ["a", "b", "c"]
    keep_recent(graphs, "a", 4, 10, lambda e: e)  # a used again: now the most recent
    assert list(graphs) == ["b", "c", "a"]
    keep_recent(graphs, "d", 5, 10, lambda e: e)  # 14 > 10: b, then c, go
    assert list(graphs) == ["a", "d"]
    keep_recent(graphs, "e", 20, 10, lambda e: e)  # alone past the budget: kept, the rest go
    assert list(graphs) == ["e"]


def test_warm_leaves_the_scratch_block_finite_on_the_torch_path(tiny_llama, monkeypatch):
    """`warm`'s capture runs (simulated here: the CPU captures nothing) of verify and batched
    verify steps write through the scratch block. On the torch attention path (the Triton
    kernels off: ROCm, LAYERSPLIT_FUSED_KERNELS=0) a row that saw no key at all would write NaN
    rows there, which every later step reading past its table's end would carry into its
    output: every row of those runs sees a key."""
    from layersplit.shards import graphs

    model = load_layer_range(open_checkpoint(tiny_llama), 0, 6)
    ex = RangeExecutor(model, 256, 3, static_decode=True, graph_bucket=32, paged=(48, 16))
    static = ex.static
    monkeypatch.setattr(graphs, "capture", lambda fn, pool: (None, fn()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    static.capture = True
    captured, _ = static.warm((1, 4), 3, verify_batch=3)
    assert captured == len(static.warm_plan((1, 4), 3, verify_batch=3)[0])
    assert any(kind == "vbatch" for kind, *_ in static.warm_plan((1, 4), 3, verify_batch=3)[0])
    assert torch.isfinite(ex.kv.k_store).all() and torch.isfinite(ex.kv.v_store).all()
    static.capture = False
    ex.kv.set_table(0, 0, [5])  # a step at row 3 of a 16-row table reads 29 keys past it
    ex.run(torch.arange(3, 6), 0, 0)
    assert torch.isfinite(ex.run(torch.tensor([7]), 3, 0)).all()
