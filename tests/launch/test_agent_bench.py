"""bench/agent_session.py against the real server: a turn's TTFT is the sum of its named phases
(the server's, then `outside`: the rest of the client's TTFT, outside the server's clock), and
the server's phases fit inside the client's TTFT (the client starts its clock at the request's
send, so the rest is never negative). How small the rest is, is a measure of the machine (the
bench reports it: `bench/RESULTS.md`, A1), not a test's: on a loaded CI machine a kept
connection's round trip took 10-50 ms."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from tests.launch.test_server import Server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama"


def _bench(name: str):
    """The benchmark script `bench/NAME.py` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    s = Server(tiny_llama, "--max-context", "1024",
               cache_dir=tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


def test_a_turns_ttft_is_its_named_phases_and_the_servers_fit_inside_it(server):
    bench = _bench("agent_session")
    messages = [{"role": "system", "content": "you are an agent: read the files, answer briefly"}]
    with httpx.Client() as client:
        sums = bench.phase_sums(client, server.url)
        for turn in range(4):
            messages.append({"role": "user", "content": f"turn {turn}: open file {turn}"})
            r = bench.ask(client, server.url, MODEL, messages, 8, {"ignore_eos": True})
            now = bench.phase_sums(client, server.url)
            ph = bench.turn_phases(r["ttft_s"], sums, now)
            sums = now
            assert {"prefill", "emit", "outside"} <= set(ph), ph
            assert sum(ph.values()) == pytest.approx(r["ttft_s"] * 1e3, abs=1e-6)
            assert 0.0 <= ph["outside"] <= r["ttft_s"] * 1e3, ph
            assert ph["prefill"] > 0.0, ph
            messages.append({"role": "assistant", "content": r["text"]})


@pytest.mark.slow
def test_first_request_bench_prompts_share_no_prefix_and_come_back_from_disk(tiny_llama,
                                                                            tmp_path):
    """bench/first_request.py's premise: within a phase every request does the same work (its
    own prompt, none cached by another's), and after a restart on the same cache directory
    each is restored whole from the disk tier."""
    from layersplit.runtime.tokenizer import TextTokenizer

    bench = _bench("first_request")
    convs = bench.prompts(TextTokenizer.for_model(tiny_llama), 3, 60)
    serve = ("--max-context", "1024", "--keep-answers", "0")
    s = Server(tiny_llama, *serve, cache_dir=tmp_path / "kv")
    try:
        first = bench.phase(s.url, MODEL, convs, 4, "fresh")
    finally:
        assert s.stop() == 0
    s = Server(tiny_llama, *serve, cache_dir=tmp_path / "kv")
    try:
        again = bench.phase(s.url, MODEL, convs, 4, "restarted")
    finally:
        s.stop()
    assert [r["cached_tokens"] for r in first["requests"]] == [0, 0, 0], first
    assert all(r["prompt_tokens"] > 60 for r in first["requests"]), first
    assert not first["restored"] and again["restored"], (first, again)
    for a, b in zip(first["requests"], again["requests"], strict=True):
        assert b["prompt_tokens"] == a["prompt_tokens"]
        assert b["cached_tokens"] >= a["prompt_tokens"] - 16, (a, b)  # (a chunk's end)
