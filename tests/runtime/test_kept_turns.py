"""A finished turn kept in the prefix cache (`RequestFlow.keep_turn`): its rows are those a cold
prefill computes, its entry carries the DFlash draft's feature rows, and the next turn, asked at
once, waits for it, restores it and speculates from its first token, in RAM and after a restart
from disk, with the output of a cold run (tokens, and float32 logits bit for bit)."""

from __future__ import annotations

import json
import struct

import pytest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator
from layersplit.shards.sampling import SamplingParams

from tests.helpers import assert_same_run, run_speculated, shard_children

CHUNK = 16
ANSWER = SamplingParams(max_tokens=12, ignore_eos=True)
FIRST = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n<|im_start|>assistant\n"
NEXT = "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
OTHER = "\n<|im_start|>user\nwhy on the mat?<|im_end|>\n<|im_start|>assistant\n"


def _cfg(target, dflash, tmp_path, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(target), devices=("cpu", "cpu"), prefill_chunk=CHUNK,
                         max_context=256, threads=1, draft=str(dflash),
                         kv_cache_dir=str(tmp_path), **kw)


def _entry(tmp_path, length: int) -> dict:
    """Header of the disk entry whose rows end at `length`."""
    for f in tmp_path.glob("*.safetensors"):
        data = f.read_bytes()
        head = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
        if int(head["__metadata__"]["length"]) == length:
            return head
    raise AssertionError(f"no entry ends at {length}")


@pytest.mark.slow
def test_a_kept_turn_restores_with_its_feature_rows(target, dflash, tmp_path):
    with Coordinator(_cfg(target, dflash, tmp_path)) as coord:
        tok = coord.tokenizer
        prompt = tok.encode(FIRST)
        answer = coord.generate(prompt, ANSWER).tokens
        turn = prompt + answer + [coord.eos_ids[0]]  # (the end of turn: a chunk boundary)
        nxt = turn + tok.encode(NEXT)
        other = turn + tok.encode(OTHER)  # (asked after a restart only)
        cold, cold_other = (run_speculated(coord, p, ANSWER, speculative=False)[:2]
                            for p in (nxt, other))
        assert coord.keep_turn(prompt + answer[:2]) is None  # (too few new tokens)
        keep = coord.keep_turn(turn + tok.encode("\n"))  # cut after the end of turn
        assert keep is not None
        # queued at once: it waits for the kept turn
        warm, logits, _ = run_speculated(coord, nxt, ANSWER, use_cache=True)
        assert keep.done and warm.cache_tier == "ram" and warm.cached_tokens == len(turn)
        st = coord.cache.stats  # (the keep took the prompt's blocks, the next turn the
        # keep's, still in the pool; the draft's feature rows from the RAM entry: it speculates)
        assert st.hits_resident == st.hits_ram == 2
        assert warm.acceptance_length is not None  # it speculated from its first token
        assert_same_run((warm, logits), cold, "RAM")
        assert coord.keep_turn(turn) is None  # (cached already)
    assert shard_children() == []
    head = _entry(tmp_path, len(turn))
    assert "draft.feature_data" in head and json.loads(head["__metadata__"]["features"])
    with Coordinator(_cfg(target, dflash, tmp_path)) as coord:
        disk, logits, _ = run_speculated(coord, other, ANSWER, use_cache=True)
        assert disk.cache_tier == "disk" and disk.cached_tokens == len(turn)
        assert disk.acceptance_length is not None
        assert_same_run((disk, logits), cold_other, "disk")


def test_keep_answers_is_checked():
    from layersplit.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="keep_answers=-1: must be at least 0"):
        RuntimeConfig(keep_answers=-1)
