"""`capture_at_start`: after configuring, the coordinator has every shard capture, all at once,
the step graphs a request may replay (`warm`, `StaticDecoder.warm`). CPU shards
capture nothing and answer at once (the captures themselves: `tests/gpu/test_warm.py`); a bad
`warm` message is refused by name and the runtime goes on serving."""

from __future__ import annotations

import re
import time

import pytest
from layersplit.ipc.messages import message
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.errors import ShardFailure
from layersplit.shards.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = list(range(5, 30))


def _cfg(model, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model), devices=("cpu", "cpu"), threads=1, max_context=128,
                         prefix_cache=False, **kw)


@pytest.mark.slow
def test_warm_round_trip_and_bad_warm_messages(tiny_llama):
    with Coordinator(_cfg(tiny_llama, capture_at_start=False)) as c:
        assert c.warmed == []  # none was sent
        want = c.generate(PROMPT, PARAMS).tokens
    with Coordinator(_cfg(tiny_llama)) as c:
        # every shard answered the warm sent at start (a CPU shard captures nothing, and has
        # no compile cache unless it is given one: `shards.compile_cache`)
        assert c.warmed == [{"graphs": 0, "seconds": 0.0, "compile_cache": "off"}] * 2
        assert c.generate(PROMPT, PARAMS).tokens == want
        for sh in c.shards:
            got = c._call(sh, message("warm", rows=[1, 4], batch=8), time.monotonic() + 30)
            assert got["type"] == "ok" and got["info"] == {"graphs": 0, "seconds": 0.0,
                                                           "compile_cache": "off"}
        max_step = c.config.prefill_chunk + c.config.max_seqs  # the shards' rows of a step
        cases = [
            ({"rows": [], "batch": 1}, "warm: rows [] must be 1..{max_step}"),
            ({"rows": [0], "batch": 1}, "warm: rows [0] must be"),
            ({"rows": [max_step + 1], "batch": 1}, f"rows [{max_step + 1}] must be"),
            ({"rows": ["1"], "batch": 1}, "rows ['1'] must be"),
            ({"rows": [True], "batch": 1}, "rows [True] must be"),
            ({"rows": [1], "batch": -1}, "warm: batch -1 must be 0.."),
            ({"rows": [1], "batch": 1, "verify_batch": -2}, "warm: verify_batch -2 must be 0.."),
            ({"rows": [1], "batch": 1, "verify_batch": "8"}, "warm: verify_batch 8 must be 0.."),
            ({"rows": 1, "batch": 1}, "warm: field 'rows' must be list, got int"),
            ({"rows": [1]}, "warm: field 'batch' is missing"),
        ]
        for fields, why in cases:
            why = why.format(max_step=max_step)
            with pytest.raises(ShardFailure, match=re.escape(why)):
                c._call(c.shards[1], message("warm", **fields), time.monotonic() + 30)
            assert c.failed is None
        assert c.generate(PROMPT, PARAMS).tokens == want  # nothing lost
