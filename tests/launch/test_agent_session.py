"""A multi-turn conversation against the real server through the `openai` client: each answer
joins the prefix cache, so the next turn restores the previous prompt and answer and prefills
only its new message; the same after a restart (same cache directory) and after a restart into
another split; a turn served from the cache has a cold run's logprobs; a kept answer whose file
is cut short or corrupt is a miss with a cold run's tokens."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.chunking import cut_points

from tests.helpers import shard_children
from tests.launch.test_server import Server, _metric
from tests.runtime.test_prefix_cache import _corrupt

openai = pytest.importorskip("openai")
MODEL = "llama"
CHUNK, EOS = 16, (2,)  # the test server's prefill chunk; the tiny model's end of turn
ANSWER = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
SERVE = ("--keep-answers", "4", "--keep-answers-delay-ms", "0",  # (kept before the next turn)
         "--max-context", "1024")
SYSTEM = {"role": "system", "content": "you are an agent: read the files, then answer briefly"}


def _user(turn: int, branch: str = "") -> dict:
    return {"role": "user", "content": f"turn {turn}{branch}: open file {turn}, say what it holds"}


def _turn_end(tok: TextTokenizer, messages: list[dict]) -> int:
    """Where the next turn's prompt stops matching a cold render: the last chunk boundary of the
    conversation with its answer (the answer's end of turn)."""
    ids = tok.encode_chat(messages, add_generation_prompt=False)
    return max(cut_points(ids, CHUNK, EOS))


def _ask(server: Server, messages: list[dict], **kw) -> tuple[str, int, int, int]:
    """(answer, prompt tokens, answer tokens, cached tokens)"""
    r = server.client.chat.completions.create(messages=messages, **{**ANSWER, **kw})
    u = r.usage
    return (r.choices[0].message.content, u.prompt_tokens, u.completion_tokens,
            u.prompt_tokens_details.cached_tokens)


def _answered(turn: tuple) -> list[dict]:
    """A turn's conversation with its answer."""
    return [*turn[0], {"role": "assistant", "content": turn[1]}]


def _entry_ending_at(cache: Path, length: int) -> Path:
    """The disk entry whose rows end at `length`."""
    for f in sorted(cache.glob("*.safetensors")):
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        meta = json.loads(f.read_bytes()[8:8 + n])["__metadata__"]
        if int(meta["length"]) == length:
            return f
    raise AssertionError(f"no entry ends at {length}")


@pytest.fixture(scope="module")
def tok(tiny_llama) -> TextTokenizer:
    return TextTokenizer.for_model(tiny_llama)


@pytest.fixture(scope="module")
def conversation(tiny_llama, tok, tmp_path_factory):
    """Six turns on a 3+3 server with a disk cache: per turn (messages, answer, prompt tokens,
    answer tokens, cached tokens), then the server is stopped."""
    cache = tmp_path_factory.mktemp("kv")
    s = Server(tiny_llama, *SERVE, cache_dir=cache)
    turns, messages = [], [SYSTEM]
    try:
        for t in range(6):
            messages = [*messages, _user(t)]
            answer, prompt, n, cached = _ask(s, messages)
            turns.append((messages, answer, prompt, n, cached))
            messages = [*messages, {"role": "assistant", "content": answer}]
        # served from the cache, the last turn has a cold run's logprobs
        last = turns[-1][0]
        lp = dict(logprobs=True, top_logprobs=5)
        warm = s.client.chat.completions.create(messages=last, **ANSWER, **lp)
        cold = s.client.chat.completions.create(
            messages=last, **{**ANSWER, "extra_body": {"ignore_eos": True, "use_cache": False}},
            **lp)
        assert warm.usage.prompt_tokens_details.cached_tokens > 0
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
               for e in warm.choices[0].logprobs.content]
        want = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in cold.choices[0].logprobs.content]
        assert got == want  # float32 on CPU: the same bits
        # every turn after the first took the kept answer's blocks, still in the KV pool
        assert _metric(s, "layersplit_prefix_cache_resident_hits_total") >= 5
        assert _metric(s, "layersplit_prefix_cache_resident_hits_total") <= \
            _metric(s, 'layersplit_prefix_cache_hits_total{tier="ram"}')
    finally:
        assert s.stop() == 0
    assert shard_children() == []
    return cache, turns


@pytest.fixture(scope="module")
def restarted(conversation, tiny_llama):
    """The server restarted on the same directory: two branches of a seventh turn (their
    conversations with the answer; the cached tokens of each), then turns 5 and 6 again
    (answer, cached tokens each; replayed, the sixth keeps its answer again)."""
    cache, turns = conversation
    s = Server(tiny_llama, *SERVE, cache_dir=cache)
    try:
        base = _answered(turns[-1])
        branches, cached = {}, {}
        for b in ("a", "b"):
            messages = [*base, _user(6, b)]
            answer, _, _, cached[b] = _ask(s, messages)
            branches[b] = [*messages, {"role": "assistant", "content": answer}]
        again = [_ask(s, messages)[::3] for messages, *_ in turns[4:]]
    finally:
        assert s.stop() == 0
    return again, branches, cached


@pytest.fixture(scope="module")
def other_split(conversation, restarted, tiny_llama, tok):
    """The files of the seventh turn's kept answers cut short (branch a) and flipped (b), then
    the server restarted into another split (2 + 4 layers) on the same directory."""
    cache, _ = conversation
    for b, how in (("a", "truncate"), ("b", "flip")):
        _corrupt(_entry_ending_at(cache, _turn_end(tok, restarted[1][b])), how)
    s = Server(tiny_llama, *SERVE, "--split", "2,4", cache_dir=cache)
    yield s
    assert s.stop() == 0
    assert shard_children() == []


@pytest.mark.slow
def test_each_turn_restores_the_previous_prompt_and_answer(conversation, tok):
    _, turns = conversation
    assert turns[0][4] == 0
    for (prev, answer, prompt, n, _), (_, _, _, _, cached) in zip(turns, turns[1:]):
        end = _turn_end(tok, [*prev, {"role": "assistant", "content": answer}])
        assert cached == end, (cached, end)
        assert cached >= prompt + n  # the prompt, the answer, and its end of turn


def _restored_from_disk(turns: list, got: list[tuple[str, int]], tok: TextTokenizer) -> None:
    """Each replayed turn restored up to its previous answer's end of turn, same answer."""
    for (prev, answer, *_), (_, want, *_), (text, cached) in zip(turns[3:], turns[4:], got):
        assert cached >= _turn_end(tok, [*prev, {"role": "assistant", "content": answer}])
        assert text == want


def _answer_restored(turns: list, cached: int, tok: TextTokenizer) -> None:
    """A new turn after the last one restored its prompt and its answer: past the last turn's
    own prompt entry (which a replayed turn finds whether or not answers reach the disk)."""
    assert cached == _turn_end(tok, _answered(turns[-1])), cached
    assert cached > max(cut_points(tok.encode_chat(turns[-1][0]), CHUNK, EOS))


@pytest.mark.slow
def test_a_restart_restores_every_turn_from_disk(conversation, restarted, tok):
    _restored_from_disk(conversation[1], restarted[0], tok)
    for cached in restarted[2].values():  # the seventh turn, first asked after the restart
        _answer_restored(conversation[1], cached, tok)


@pytest.mark.slow
def test_a_restart_into_another_split_restores_every_turn(conversation, other_split, tok):
    turns = conversation[1]
    _answer_restored(turns, _ask(other_split, [*_answered(turns[-1]), _user(6, "c")])[3], tok)
    _restored_from_disk(turns, [_ask(other_split, m)[::3] for m, *_ in turns[4:]], tok)


@pytest.mark.slow
def test_a_kept_answer_cut_short_or_corrupt_is_a_miss(restarted, other_split, tok):
    """The eighth turn of each branch restores up to the seventh turn's prompt only (its
    answer's entry is a miss) and answers as a cold run does."""
    for b, conv in restarted[1].items():
        messages = [*conv, _user(7, b)]
        got, _, _, cached = _ask(other_split, messages)
        assert cached == max(cut_points(tok.encode_chat(conv[:-1]), CHUNK, EOS)), b
        cold = _ask(other_split, messages, extra_body={"ignore_eos": True, "use_cache": False})
        assert got == cold[0]
