"""A token tree's kept rows move exactly once on every shard: the last shard moves them as soon
as it has sampled their verify step (`shards.early_moves`), the others with the sequence's next
step. The tree here keeps rows 2 and 3 of [wrong, t1, t2] (parents 0, 0, 2): row 3 moves onto
row 2 after row 2 moved onto row 1, so a second move, or none, leaves other K/V in rows 1 and 2,
and the next steps' logits show it."""

from __future__ import annotations

import numpy as np
import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.sampling import SamplingParams

from tests.helpers import layersplit_shm, shard_children, trace

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
CHUNK = 16
CASES = [(1, "auto"), (2, "shm"), (2, "zmq"), (3, "zmq")]


def check_kept_rows_move_once(model, devices: tuple[str, ...], atol: float, **config) -> None:
    """Plain greedy decoding, then the same prompt again with a tree verify step that keeps
    rows 2 and 3, then three decode steps: their logits must be plain decoding's."""
    cfg = RuntimeConfig(model=str(model), devices=devices, prefill_chunk=CHUNK,
                        max_context=128, **config)
    with Coordinator(cfg) as coord:
        prompt = coord.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 2)
        t, logits = trace(coord, prompt, 6, CHUNK)  # plain: tokens t0 .. t5 and logits
        chunks = len(logits) - 6  # logits[chunks + k]: of t_k's step, at position len + k
        out = None
        for a, b in prefill_chunks(prompt, 0, len(prompt), CHUNK, (2,)):
            out = coord.forward(prompt[a:b], a, GREEDY, 0)
        assert out.token == t[0]
        pos = len(prompt)
        wrong = (t[1] + 1) % coord.model_config.vocab_size
        out = coord.forward([t[0], wrong, t[1], t[2]], pos, GREEDY, 0,
                            draft=[wrong, t[1], t[2]], tree=[0, 0, 2])
        assert (out.accepted, out.path, out.token) == (2, [2, 3], t[3])
        for k in (3, 4, 5):  # the kept rows (positions len + 1, len + 2) are attended here
            out = coord.forward([t[k]], pos + k, GREEDY, 0, want_logits=True,
                                kept=[2, 3] if k == 3 else None)
            np.testing.assert_allclose(out.logits, logits[chunks + k], rtol=0, atol=atol)
            if k < 5:
                assert out.token == t[k + 1]
        assert len(shard_children()) == len(devices)


@pytest.mark.slow
@pytest.mark.parametrize("n,transport", CASES, ids=[f"{n}shard-{t}" for n, t in CASES])
def test_kept_tree_rows_move_once_and_decode_as_plain(tiny_llama, n, transport):
    before = layersplit_shm()
    check_kept_rows_move_once(tiny_llama, ("cpu",) * n, 1e-4, threads=1,
                              transport=(transport,))
    assert shard_children() == []
    assert layersplit_shm() - before == set()
