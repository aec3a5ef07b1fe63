"""A turn that continues a finished answer before the server kept it (`keep_answers_delay_ms`)
does not wait behind the keep: it prefills the answer with its own new tokens, snapshots the
answer's end as the keep would have (the entry is on disk, and the next turn restores it), and
answers as a cold run does (float32 on CPU: the same logprobs)."""

from __future__ import annotations

import time

from layersplit.runtime.tokenizer import TextTokenizer
from layersplit.shards.chunking import cut_points

from tests.helpers import shard_children
from tests.launch.test_agent_session import (
    ANSWER,
    CHUNK,
    EOS,
    SYSTEM,
    _answered,
    _ask,
    _entry_ending_at,
    _turn_end,
    _user,
)
from tests.launch.test_server import Server

LATER_MS = "60000"  # a keep not taken over would run after the test is over


def _logprobs(s: Server, messages: list[dict], **body) -> list:
    r = s.client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=5,
        **{**ANSWER, "extra_body": {"ignore_eos": True, **body}})
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in r.choices[0].logprobs.content]


def _wait_for_entry(cache, end: int, timeout_s: float = 30.0) -> None:
    """Until the disk entry ending at `end` is there (AssertionError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _entry_ending_at(cache, end)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

def test_a_turn_continuing_an_answer_not_kept_yet_keeps_it_itself(tiny_llama, tmp_path):
    tok = TextTokenizer.for_model(tiny_llama)
    s = Server(tiny_llama, "--keep-answers", "4", "--keep-answers-delay-ms", LATER_MS,
               "--max-context", "1024", cache_dir=tmp_path)
    try:
        first = [SYSTEM, _user(0)]
        answer, prompt, n, cached = _ask(s, first)
        assert cached == 0
        turn1 = (first, answer)
        second = [*_answered(turn1), _user(1)]
        end = _turn_end(tok, _answered(turn1))
        got = _ask(s, second)
        # its prompt's own entry restored, not the answer's (no keep ran: it prefilled it)
        assert got[3] == max(cut_points(tok.encode_chat(first), CHUNK, EOS)) < end, (got, end)
        _wait_for_entry(tmp_path, end)  # (its save runs in the background)
        third = [*_answered((second, got[0])), _user(2)]
        assert _ask(s, third)[3] >= end
        # the turn that kept the answer answered as a cold run does
        again = [*_answered(turn1), _user(1, "b")]
        assert _logprobs(s, again) == _logprobs(s, again, use_cache=False)
    finally:
        assert s.stop() == 0
    assert shard_children() == []


def test_an_answer_no_request_continues_is_kept_after_the_delay(tiny_llama, tmp_path):
    tok = TextTokenizer.for_model(tiny_llama)
    s = Server(tiny_llama, "--keep-answers", "4", "--keep-answers-delay-ms", "200",
               "--max-context", "1024", cache_dir=tmp_path)
    try:
        first = [SYSTEM, _user(0)]
        answer = _ask(s, first)[0]
        end = _turn_end(tok, _answered((first, answer)))
        _wait_for_entry(tmp_path, end)  # (the keep started after its delay, the server idle)
        got = _ask(s, [*_answered((first, answer)), _user(1)])
        assert got[3] == end, got
    finally:
        assert s.stop() == 0
    assert shard_children() == []


def test_a_server_that_stops_keeps_the_answers_it_delayed(tiny_llama, tmp_path):
    tok = TextTokenizer.for_model(tiny_llama)
    serve = ("--keep-answers", "4", "--keep-answers-delay-ms", LATER_MS, "--max-context", "1024")
    first = [SYSTEM, _user(0)]
    s = Server(tiny_llama, *serve, cache_dir=tmp_path)
    try:
        answer = _ask(s, first)[0]
    finally:
        assert s.stop() == 0
    s = Server(tiny_llama, *serve, cache_dir=tmp_path)
    try:
        got = _ask(s, [*_answered((first, answer)), _user(1)])
        assert got[3] == _turn_end(tok, _answered((first, answer))), got
    finally:
        assert s.stop() == 0
    assert shard_children() == []
