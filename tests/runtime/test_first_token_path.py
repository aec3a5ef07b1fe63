"""A cached turn's path to its first token: the prefill chunks after its restored prefix follow
each other into the shard chain without waiting for results, also the chunk that ends at a
cache point inside the prompt (its logits, for that point's entry, are read as they come back)
and the prompt's last chunk, which samples the first token; the output is the cold run's, and
the entries those points leave restore into it, from RAM and from disk."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_logged, shard_children

CHUNK = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _cfg(target: Path, n: int, cache_dir: Path) -> RuntimeConfig:
    return RuntimeConfig(model=str(target), devices=("cpu",) * n, prefill_chunk=CHUNK,
                         max_context=256, max_seqs=2, threads=1, draft="none",
                         kv_cache_dir=str(cache_dir))


def _prompts(eos: int, vocab: int) -> tuple[list[int], list[int]]:
    """A 32-token turn, and the next one (60 tokens) that starts with it: its end of turn at
    51 makes 52 a cut point, so after the restored 32 rows it prefills chunks [32, 48),
    [48, 52) (ending at the cache point of the prompt's last cut) and [52, 60)."""
    rng = random.Random(5)
    toks = [rng.randrange(3, vocab) for _ in range(60)]
    toks = [t if t != eos else t + 1 for t in toks]
    toks[51] = eos
    return toks[:32], toks


def _prefill_sends_and_results(trace: Path) -> list[tuple[str, int, int]]:
    """(event, step id, rows) of the coordinator's prefill sends and every result, in order."""
    (path,) = trace.glob("coordinator-*.jsonl")
    out, rows = [], {}
    for line in path.read_text().splitlines():
        _, event, sid, details = json.loads(line)
        if event == "send" and details.get("kind") == "prefill":
            rows[sid] = details["rows"]
            out.append(("send", sid, details["rows"]))
        elif event == "result" and sid in rows:
            out.append(("result", sid, rows[sid]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_chunks_after_a_restore_follow_each_other(target, tmp_path, monkeypatch, n):
    trace = tmp_path / "trace"
    trace.mkdir(mode=0o700)
    monkeypatch.setenv("LAYERSPLIT_STEP_TRACE", str(trace))
    ref = ReferenceEngine(target, prefill_chunk=CHUNK, max_context=256)
    with Coordinator(_cfg(target, n, tmp_path / "cache")) as c:
        first, turn = _prompts(c.eos_ids[0], c.model_config.vocab_size)
        want = {len(p): run_logged(ref, p, GREEDY) for p in (first, turn[:52], turn)}
        assert_same_run(run_logged(c, first, GREEDY), want[32], "cold")
        got = run_logged(c, turn, GREEDY)
        assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", 32)
        assert_same_run(got, want[60], "restored")
        # the entries of the cache points restore into the cold output (the one at 52 holds
        # the logits read from a step nobody waited for: an exact hit needs them)
        for p in (turn[:52], turn):
            got = run_logged(c, p, GREEDY)
            assert (got[0].cache_tier, got[0].cached_tokens) == ("ram", len(p))
            assert_same_run(got, want[len(p)], f"exact RAM hit of {len(p)}")
    events = _prefill_sends_and_results(trace)
    # the restored turn's chunks: [32, 48), [48, 52), [52, 60); every one was sent before the
    # first came back
    sent = [e for e in events if e[0] == "send"]
    chunks = [sid for _, sid, _ in sent[2:5]]
    assert [rows for *_, rows in sent[2:5]] == [16, 4, 8], events
    after = events[events.index(("send", chunks[0], 16)):]
    first_result = next(i for i, e in enumerate(after) if e[0] == "result")
    assert [sid for ev, sid, _ in after[:first_result]] == chunks, after
    with Coordinator(_cfg(target, n, tmp_path / "cache")) as c:  # a restart: the disk tier
        for p in (turn[:52], turn):
            got = run_logged(c, p, GREEDY)
            assert got[0].cache_tier == "disk" and got[0].cached_tokens == len(p)
            assert_same_run(got, want[len(p)], f"disk hit of {len(p)}")
    assert shard_children() == []

