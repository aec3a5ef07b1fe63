"""The real server on a loopback port, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from layersplit.ipc.sockets import free_tcp_port
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import layersplit_shm, shard_children, wait_gone
from tests.launch.http_fuzz import cases, check_answer

openai = pytest.importorskip("openai")


# The tests' HTTP client: one, since each `httpx.get`/`httpx.post` builds a client whose TLS
# context loads the CA bundle (~27 ms, more than a request to the tiny model); no keep-alive,
# so that no request races a connection the server is closing.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


class Server:
    def __init__(self, model: Path, *extra: str, cache_dir: Path | None = None) -> None:
        self.port = free_tcp_port()
        cmd = [sys.executable, "-m", "layersplit.launch.cli", "serve", "--model", str(model),
               "--devices", "cpu,cpu", "--threads", "1", "--prefill-chunk", "16",
               "--port", str(self.port), "--max-context", "512", *extra]
        if cache_dir is not None:
            cmd += ["--kv-cache-dir", str(cache_dir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if HTTP.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server died: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        else:
            raise RuntimeError("server did not become ready")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self) -> int:
        """SIGTERM; returns 0 for a clean shutdown (uvicorn re-raises the signal once it has
        shut down gracefully, so -SIGTERM is clean too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()
        return 0 if rc in (0, -signal.SIGTERM) else rc


MAX_BODY = 1 << 18  # the test server's max_body_mb: oversized bodies stay cheap


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The module's plain server; its last test kills its shards (`test_shard_kill_mid_stream`)."""
    before = layersplit_shm()
    s = Server(tiny_llama, "--max-body-mb", str(MAX_BODY / 2**20))
    yield s
    assert s.stop() == 0
    assert shard_children() == [] and layersplit_shm() - before == set()


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=512)


MODEL = "llama"  # served model id: the checkpoint folder's name


@pytest.mark.slow
def test_completions_and_chat_streamed_equal_unstreamed(server, ref):
    c = server.client
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=10,
                             temperature=0)
    want = ref.generate(ref.tokenizer.encode("the quick brown fox"),
                        SamplingParams(max_tokens=10))
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.tokens)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=10, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    msgs = [{"role": "user", "content": "tell me about foxes"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    ids = ref.tokenizer.encode_chat(msgs)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == ref.generate(
        ids, SamplingParams(max_tokens=12)).text


@pytest.mark.slow
def test_seeded_sampling_and_stop(server):
    c = server.client
    kw = dict(model=MODEL, prompt="once upon a time", max_tokens=16, temperature=1.0,
              top_p=0.9, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    # a random-weight model emits many partial UTF-8 bytes: pick a prompt whose greedy text
    # has a clean two-character piece to stop at
    for i in range(40):
        prompt = f"prompt {i}:"
        text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                    temperature=0).choices[0].text
        clean = [j for j in range(1, len(text) - 2) if "\ufffd" not in text[j:j + 2]
                 and text[j:j + 2].strip() and text.find(text[j:j + 2]) == j]
        if clean:
            stop = text[clean[0]:clean[0] + 2]
            break
    else:
        raise AssertionError("no prompt gave a clean stop string")
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                             stop=[stop])
    assert r.choices[0].text == text[:clean[0]] and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_zero_max_tokens_answers_at_once(server):
    """A request with nothing to generate ends at submission: answered, streamed or not, and
    the engine is not left busy with it."""
    c = server.client
    t0 = time.monotonic()
    r = c.completions.create(model=MODEL, prompt="nothing", max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0
    chunks = list(c.completions.create(model=MODEL, prompt="nothing", max_tokens=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ""
    assert c.completions.create(model=MODEL, prompt="next", max_tokens=2,
                                temperature=0).usage.completion_tokens == 2
    assert time.monotonic() - t0 < 20


@pytest.mark.slow
def test_cached_tokens_grow_on_the_second_turn(server):
    c = server.client
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}]
    r1 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "second question"}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > \
        r1.usage.prompt_tokens_details.cached_tokens
    off = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                    extra_body={"use_cache": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].message.content == r2.choices[0].message.content


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": "x", "temperature": 9}', 400, "temperature"),
    (b'{"prompt": "x", "n": 9}', 400, "n"),  # over max_seqs
    (b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),  # over max_logprobs
    (b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
    (b'{"prompt": "' + b"word " * 600 + b'"}', 400, "prompt"),
    (b'[1, 2]', 400, None),
    (b'{"prompt": ' + b'[' * 5000 + b']' * 5000 + b'}', 400, None),  # past the recursion limit
    (b'{"prompt": "x", "seed": 18446744073709551616}', 400, "seed"),
    (b'{"prompt": "x", "temperature": 1e400}', 400, "temperature"),
    (b'{"prompt": "x", "top_k": 1099511627776}', 400, "top_k"),
])
@pytest.mark.slow
def test_invalid_requests(server, body, status, param):
    r = HTTP.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


@pytest.mark.slow
def test_chat_validation(server):
    r = HTTP.post(server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = HTTP.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": 5}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


@pytest.mark.slow
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "body"),
])
def test_lone_surrogate_fails_alone(server, ref, path, body, param):
    """Valid JSON that is not valid Unicode: a 400 naming the field, and the server goes on
    (it used to kill the engine thread, so that every later request hung)."""
    r = HTTP.post(server.url + path, content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = server.client.completions.create(model=MODEL, prompt="the next request", max_tokens=4,
                                         temperature=0)
    want = ref.generate(ref.tokenizer.encode("the next request"),
                        SamplingParams(max_tokens=4, temperature=0))
    assert r.choices[0].text == want.text
    assert HTTP.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_fuzzed_bodies_fail_alone(server, ref):
    """Hypothesis-made bad bodies for the four endpoints (`tests/launch/http_fuzz.py`: wrong
    types, missing fields, huge numbers, nested junk, bytes that are not UTF-8, lone
    surrogates, non-JSON, oversized bodies, unknown fields): each gets its 4xx with an OpenAI
    error naming what was wrong, the server stays up, and the next well-formed request gets the
    reference output. The campaign with larger counts: `bench/http_fuzz.py`."""

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(case=cases(MODEL, MAX_BODY))
    def one(case):
        event(f"{case.path} {case.mutation}")
        problem = check_answer(case, case.send(server.url, client=HTTP))
        assert problem is None, f"{case.mutation} to {case.path}: {problem}\n{case.body[:400]!r}"
        assert server.proc.poll() is None, "the server exited"

    one()
    assert HTTP.get(server.url + "/health", timeout=5).status_code == 200
    r = server.client.completions.create(model=MODEL, prompt="after the fuzz", max_tokens=4,
                                         temperature=0)
    want = ref.generate(ref.tokenizer.encode("after the fuzz"),
                        SamplingParams(max_tokens=4, temperature=0))
    assert r.choices[0].text == want.text


@pytest.mark.slow
def test_sixteen_concurrent_streams(server, ref):
    prompts = [f"story number {i} begins" for i in range(16)]

    def one(p):
        return "".join(ch.choices[0].text for ch in server.client.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True))

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, prompts))
    for p, text in zip(prompts, got):
        assert text == ref.generate(ref.tokenizer.encode(p), SamplingParams(max_tokens=8)).text
    # they ran as one continuous batch: some steps carried several sequences
    metrics = HTTP.get(server.url + "/metrics").text
    single = float(re.search(r'layersplit_step_sequences_bucket\{le="1.0"\} (\S+)', metrics)[1])
    steps = float(re.search(r"layersplit_step_sequences_count (\S+)", metrics)[1])
    assert steps > single


@pytest.mark.slow
def test_metrics_and_health(server):
    server.client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    h = HTTP.get(server.url + "/health").json()
    assert h["status"] == "ready"
    text = HTTP.get(server.url + "/metrics").text
    for name in ("layersplit_requests_total", "layersplit_time_to_first_token_seconds",
                 "layersplit_inter_token_latency_seconds", "layersplit_prefix_cache_hits",
                 "layersplit_step_seconds", "layersplit_shard_restarts",
                 "layersplit_generation_tokens", "layersplit_spec_acceptance_length",
                 "layersplit_spec_off_steps_total", "layersplit_spec_policy_switches",
                 "layersplit_kv_cache_usage_ratio", "layersplit_kv_host_usage_ratio",
                 'layersplit_preemptions_total{kind="swap"}'):
        assert name in text, name
    # the time to the first token, phase by phase: its phases add up to it, request by request
    phases = {m[1]: float(m[2]) for m in re.finditer(
        r'layersplit_time_to_first_token_phase_seconds_sum\{phase="(\w+)"\} (\S+)', text)}
    assert {"parse", "wait", "tokenize", "queue", "slot", "prefill", "emit"} <= set(phases)
    assert phases["prefill"] > 0
    ttft = float(re.search(r"layersplit_time_to_first_token_seconds_sum (\S+)", text)[1])
    assert sum(phases.values()) == pytest.approx(ttft, rel=1e-6, abs=1e-6)


def _metric(server: Server, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", HTTP.get(server.url + "/metrics").text,
                           re.MULTILINE)[1])


@pytest.mark.slow
def test_client_disconnect_cancels(server):
    """A client that goes away stops its request: it leaves the batch having generated a few
    tokens, not the ~500 its context (max_context 512) allows, which it would generate uncancelled
    (it asks for 100000 and ignores EOS)."""
    assert _metric(server, "layersplit_running_requests") == 0
    before = _metric(server, "layersplit_generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
            "prompt": "go on forever", "max_tokens": 100000, "stream": True,
            "ignore_eos": True, "temperature": 0}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 60
    while _metric(server, "layersplit_running_requests") > 0:  # (the engine's count)
        assert time.monotonic() < deadline, "the request still runs a minute after its client left"
        time.sleep(0.05)
    generated = _metric(server, "layersplit_generation_tokens_total") - before
    assert 3 <= generated < 200, generated
    # the engine is free again quickly: the next request is served
    t0 = time.monotonic()
    server.client.completions.create(model=MODEL, prompt="next", max_tokens=2, temperature=0)
    assert time.monotonic() - t0 < 20


KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


MSGS = [{"role": "user", "content": "remember this long question about foxes and dogs"}]


@pytest.fixture(scope="module")
def stopped_mid_request(tiny_llama, tmp_path_factory):
    """A server with a disk cache, sent SIGTERM while a request runs (once it runs): that
    request's answer, and the first of a chat asked before it. (`keyed_server` starts again
    on its cache; `test_sigterm_finishes_in_flight_request_and_a_restart_reports_cached_tokens`
    checks both.)"""
    cache = tmp_path_factory.mktemp("cache")
    s = Server(tiny_llama, "--grace-s", "20", cache_dir=cache)
    try:
        first = s.client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4,
                                                 temperature=0)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(s.client.completions.create, model=MODEL, prompt="long",
                            max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
            deadline = time.monotonic() + 30  # the signal comes once the request runs
            while _metric(s, "layersplit_running_requests") < 1:
                assert time.monotonic() < deadline and not fut.done(), "the request never ran"
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            in_flight = fut.result(timeout=60)
    finally:
        rc = s.stop()
    return cache, first, in_flight, rc


@pytest.fixture(scope="module")
def keyed_server(tiny_llama, stopped_mid_request):
    """A server with an API key and a draft (here a classic one: the target itself, so drafts
    are kept), started on the cache the server stopped mid-request left: the restart's test,
    the API key's test and the speculation test share it."""
    s = Server(tiny_llama, "--api-key", KEY, "--draft", str(tiny_llama),
               cache_dir=stopped_mid_request[0])
    kids = [k.pid for k in shard_children(s.proc.pid)]
    assert len(kids) == 3  # two shards and the draft process
    yield s
    assert s.stop() == 0
    assert wait_gone(kids) == []


@pytest.mark.slow
def test_sigterm_finishes_in_flight_request_and_a_restart_reports_cached_tokens(
        stopped_mid_request, keyed_server):
    """SIGTERM: the request in flight finishes (within --grace-s), pending cache writes too,
    and the exit is clean; the server started again (`keyed_server`) restores the first prompt
    from disk and says so. (The module's first test on `keyed_server`: no other request of
    the restarted server came before, so its one disk hit is this one.)"""
    _, first, in_flight, rc = stopped_mid_request
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert in_flight.usage.completion_tokens == 150
    assert rc == 0  # (a clean exit after the SIGTERM)
    c = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    again = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    assert 'layersplit_prefix_cache_hits_total{tier="disk"} 1.0' in \
        HTTP.get(keyed_server.url + "/metrics", headers=AUTH).text


@pytest.mark.slow
def test_api_key(keyed_server):
    s = keyed_server
    assert HTTP.get(s.url + "/v1/models").status_code == 401
    ok = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == MODEL
    for wrong in (b"Bearer sekreT", b"Bearer sekret2", b"Bearer sek", b"sekret",
                  b"Bearer s\xe9kret"):  # (compared in constant time, as bytes)
        r = HTTP.get(s.url + "/v1/models", headers={"Authorization": wrong})
        assert r.status_code == 401, wrong
    assert HTTP.get(s.url + "/health").status_code == 200  # health stays open
    for path in ("/tokenize", "/detokenize"):  # they read the model's vocabulary too
        assert HTTP.post(s.url + path, json={"prompt": "hi"}).status_code == 401
    r = HTTP.post(s.url + "/tokenize", json={"prompt": "hi"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["tokens"]


@pytest.mark.slow
def test_speculation_per_request_and_its_metrics(keyed_server):
    """With a draft, requests speculate unless they say `speculative: false`; the text is the
    same; /metrics and /health report it."""
    s = keyed_server

    def post(body: dict) -> httpx.Response:
        return HTTP.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=60)

    health = HTTP.get(s.url + "/health").json()
    assert health["speculation"] == "on (classic draft)"
    body = {"model": MODEL, "prompt": "the cat sat on", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    spec = post(body).json()
    plain = post({**body, "speculative": False}).json()
    assert "choices" in spec and "choices" in plain, (spec, plain)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    metrics = HTTP.get(s.url + "/metrics").text
    verifies = [line for line in metrics.splitlines()
                if line.startswith("layersplit_spec_verify_steps_total ")]
    assert verifies and float(verifies[0].split()[1]) >= 3  # 24 tokens, up to 5 a step
    assert 'layersplit_spec_accepted_tokens_total{position="1"}' in metrics
    assert 'layersplit_step_seconds_count{kind="verify"}' in metrics
    # a constrained request runs plainly and says why (the response's header, the log)
    body = {**body, "max_tokens": 6, "response_format": {"type": "json_object"}}
    r = post(body)
    assert r.status_code == 200
    assert r.headers["x-layersplit-speculation"] == "off: response_format/tool_choice grammar"
    r = post({**body, "logit_bias": {"5": 1}})
    assert r.headers["x-layersplit-speculation"] == (
        "off: response_format/tool_choice grammar, logit_bias")
    assert "x-layersplit-speculation" not in post({**body, "speculative": False}).headers


@pytest.mark.slow
def test_shard_kill_mid_stream(server):
    """The module's server, after its other tests (the last test of the module): a shard
    killed mid-stream fails the stream naming it and the group restarts; one killed while idle
    is noticed at once. (Its stop, clean, and no process or shared memory left: the fixture's.)"""
    s = server
    kids = shard_children(s.proc.pid)
    assert len(kids) == 2
    events = []
    with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
            "prompt": "go", "max_tokens": 100000, "stream": True, "ignore_eos": True}) as r:
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: "):
                events.append(line[6:])
            if i == 6:
                os.kill(kids[1].pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "shard 1" in err["message"]
    h = HTTP.get(s.url + "/health")
    assert h.status_code == 503 or h.json()["status"] in ("loading", "ready")
    assert wait_gone([k.pid for k in kids]) == []
    deadline = time.monotonic() + 60  # the shard group is restarted
    while HTTP.get(s.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = s.client.completions.create(model=MODEL, prompt="after", max_tokens=3,
                                    temperature=0)
    assert r.usage.completion_tokens == 3
    assert "layersplit_shard_restarts_total 1.0" in HTTP.get(s.url + "/metrics").text
    # a shard that dies while the server is idle is noticed at once (within 2 s), not by
    # the next request
    kids = shard_children(s.proc.pid)
    os.kill(kids[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    while "layersplit_shard_restarts_total 2.0" not in HTTP.get(s.url + "/metrics").text:
        assert time.monotonic() - t0 < 2.0, "an idle server did not notice a dead shard"
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while HTTP.get(s.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = s.client.completions.create(model=MODEL, prompt="again", max_tokens=3,
                                    temperature=0)
    assert r.usage.completion_tokens == 3
