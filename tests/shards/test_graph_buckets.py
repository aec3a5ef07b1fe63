"""KV-length buckets of captured step graphs (`shards.graphs.kv_buckets`): every length up to
the context has one, linear up to 16 buckets, then 8 per doubling, so a step attends at most
1/8 more keys than it has and a 128K context takes 56 graphs of a kind."""

from __future__ import annotations

import pytest
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
