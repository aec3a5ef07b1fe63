"""Invariant 1: N-shard output equals the single-process reference bit for bit (float32, CPU),
on every transport available on CPU, with 1, 2 and 3 shards and an uneven split."""

from __future__ import annotations

import numpy as np
import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, layersplit_shm, run_logged, shard_children, trace

CHUNK = 16
CASES = [  # (devices, transport, addresses, split)
    (1, "auto", "ipc", None),
    (2, "shm", "ipc", None),
    (2, "zmq", "ipc", None),
    (2, "zmq", "tcp", None),
    (3, "shm", "ipc", None),
    (3, "zmq", "tcp", None),
    (3, "auto", "ipc", (1, 4, 1)),  # uneven
]
# the one chain of the fast tier (`-m "not slow"`): the invariant end to end, over shared memory
FAST_CASE = (2, "shm", "ipc", None)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=CHUNK, max_context=256)


@pytest.fixture(scope="module")
def prompt(reference):
    # 3 chunks and a chat turn boundary (token 2 = <|im_end|>) inside the prompt
    text = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n<|im_start|>assistant\n" * 2
    ids = reference.tokenizer.encode(text)
    assert len(ids) > 2 * CHUNK
    return ids


@pytest.mark.parametrize("n,transport,addresses,split", [
    pytest.param(*c, id=f"{c[0]}shard-{c[1]}-{c[2]}" + ("-uneven" if c[3] else ""),
                 marks=() if c == FAST_CASE else pytest.mark.slow) for c in CASES])
def test_split_equals_reference(tiny_llama, reference, prompt, n, transport, addresses, split,
                                caplog):
    before = layersplit_shm()
    cfg = RuntimeConfig(model=str(tiny_llama), devices=("cpu",) * n, transport=(transport,),
                        local_addresses=addresses, split=split, prefill_chunk=CHUNK,
                        max_context=256, threads=1)
    ref_tokens, ref_logits = trace(reference, prompt, 12, CHUNK)
    with Coordinator(cfg) as coord:
        expected = "shm" if transport == "auto" else transport
        assert [s["transport_out"] for s in coord.shard_info()[:-1]] == [expected] * (n - 1)
        tokens, logits = trace(coord, prompt, 12, CHUNK)
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits)  # bit for bit
        # the full generation loop (the batch), greedy and sampled on the last shard: tokens and
        # the logits at every generated position
        for p in (SamplingParams(max_tokens=16, ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3,
                                 ignore_eos=True)):
            assert_same_run(run_logged(coord, prompt, p), run_logged(reference, prompt, p),
                            f"{n} shards, temperature {p.temperature}")
        kids = shard_children()
        assert len(kids) == n
    assert shard_children() == []
    assert layersplit_shm() - before == set()
    # every shard left on its shutdown message, in the grace period (none had to be SIGTERMed)
    assert not [m for m in caplog.messages if "still running" in m]
