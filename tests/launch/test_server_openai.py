"""The OpenAI parameters agents use, on the real server through the official `openai` client:
logprobs (chat, completions, echo), n, penalties, logit_bias, min_tokens, stop_token_ids,
/tokenize and /detokenize; lm-evaluation-harness's loglikelihoods; bad values refused by name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from layersplit.runtime.reference import ReferenceEngine
from layersplit.shards.sampling import SamplingParams

from tests.helpers import shard_children
from tests.launch.test_server import HTTP, Server

openai = pytest.importorskip("openai")
MODEL = "llama"
VOCAB = 320  # the tiny model's


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = Server(tiny_llama, "--max-logprobs", str(VOCAB), "--max-seqs", "4")
    yield s
    assert s.stop() == 0
    assert shard_children() == []


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return ReferenceEngine(tiny_llama, prefill_chunk=16, max_context=512)


def _want_logprobs(ref, ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of every row of `ids` (T = 1 when greedy)."""
    x = ref.logits(ids).float()
    return torch.log_softmax(x / (temperature or 1.0), dim=-1)


@pytest.mark.slow
def test_chat_logprobs_greedy_streamed_and_not(server, ref):
    c = server.client
    msgs = [{"role": "user", "content": "tell me about foxes"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    # the logprobs are the model's: those of the reference's logits, row by row
    ids = ref.tokenizer.encode_chat(msgs)
    gen = ref.generate(ids, SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    want = _want_logprobs(ref, ids + gen, 0.0)
    for i, e in enumerate(content):
        assert e.logprob == pytest.approx(float(want[len(ids) - 1 + i, gen[i]]), abs=1e-4)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


@pytest.mark.slow
def test_logprobs_over_the_whole_vocabulary_sum_to_one(server):
    r = server.client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4,
                                         temperature=0.7, seed=3, logprobs=VOCAB)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    # through the chat endpoint, whose top list keeps every token apart
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0.7, seed=3, logprobs=True, top_logprobs=VOCAB)
    for e in chat.choices[0].logprobs.content:
        assert len(e.top_logprobs) == VOCAB
        assert math.fsum(math.exp(t.logprob) for t in e.top_logprobs) == pytest.approx(1, abs=1e-4)
        assert e.logprob in [t.logprob for t in e.top_logprobs]


@pytest.mark.slow
def test_echo_returns_a_logprob_per_prompt_token_after_the_first(server, ref):
    prompt = "the quick brown fox jumps over the lazy dog and the cat"  # > one 16-token chunk
    ids = ref.tokenizer.encode(prompt)
    assert len(ids) > 16
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                  logprobs=2)
        if stream:
            chunks = list(server.client.completions.create(**kw, stream=True))
            text = "".join(ch.choices[0].text for ch in chunks)
            toks, lps = [], []
            for ch in chunks:
                if ch.choices[0].logprobs is not None:
                    toks += ch.choices[0].logprobs.tokens
                    lps += ch.choices[0].logprobs.token_logprobs
        else:
            r = server.client.completions.create(**kw)
            text, toks = r.choices[0].text, r.choices[0].logprobs.tokens
            lps = r.choices[0].logprobs.token_logprobs
        assert text.startswith(prompt)
        assert len(toks) == len(ids) + 2 and lps[0] is None
        want = _want_logprobs(ref, ids, 0.0)
        got = torch.tensor(lps[1:len(ids)])
        exp = torch.stack([want[i, ids[i + 1]] for i in range(len(ids) - 1)])
        assert torch.allclose(got, exp, atol=1e-4), (got - exp).abs().max()


@pytest.mark.slow
def test_n_choices_and_their_limit(server):
    c = server.client
    hits = _ram_hits(server)
    kw = dict(model=MODEL, prompt="n choices of one prompt", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(**kw, seed=11, n=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1  # seeds differ per choice
    assert r.usage.completion_tokens == 24
    # the first choice prefilled the prompt; the others restored its snapshot
    assert _ram_hits(server) == hits + 2
    for i in range(3):  # each choice is the single request of its seed
        assert c.completions.create(**kw, seed=11 + i).choices[0].text == r.choices[i].text
    # a follower's first token comes from the snapshot's stored logits: its logprobs too
    hits = _ram_hits(server)
    g = c.completions.create(model=MODEL, prompt="two greedy choices", max_tokens=4,
                             temperature=0, n=2, logprobs=2, extra_body={"ignore_eos": True})
    assert _ram_hits(server) == hits + 1
    a, b = (ch.logprobs for ch in g.choices)
    assert g.choices[0].text == g.choices[1].text and a.tokens == b.tokens
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    assert [sorted(t) for t in a.top_logprobs] == [sorted(t) for t in b.top_logprobs]
    chunks = list(c.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0, seed=2, n=2,
        stream=True))
    assert {ch.choices[0].index for ch in chunks} == {0, 1}
    assert sum(1 for ch in chunks if ch.choices[0].finish_reason) == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", n=5)
    assert e.value.body["param"] == "n"


def _ram_hits(server) -> float:
    text = HTTP.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('layersplit_prefix_cache_hits_total{tier="ram"}'))


@pytest.mark.slow
def test_logit_bias_penalties_min_tokens_and_stop_token_ids(server, ref):
    c = server.client
    ids = ref.tokenizer.encode("once upon a time")
    base = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    plain_ids = ref.generate(ids, SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    assert c.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text == (
        ref.tokenizer.decode(plain_ids))
    # a bias of 100 on a token makes greedy pick it every time
    forced = c.completions.create(**base, logit_bias={"77": 100},
                                  extra_body={"ignore_eos": True})
    assert forced.choices[0].text == ref.tokenizer.decode([77] * 6)
    # penalties: the output is greedy decoding of the penalised logits, computed here; long
    # enough (24 tokens) that the plain output repeats tokens, so penalties change something
    n_pen = 24
    plain_long = ref.generate(ids, SamplingParams(max_tokens=n_pen, ignore_eos=True)).tokens
    assert len(set(plain_long)) < n_pen
    for kw, want in (
            ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
             _greedy_penalised(ref, ids, n_pen, freq=1.5, pres=0.5)),
            ({"extra_body": {"repetition_penalty": 1.8, "ignore_eos": True}},
             _greedy_penalised(ref, ids, n_pen, rep=1.8))):
        extra = kw.pop("extra_body", {"ignore_eos": True})
        r = c.completions.create(**{**base, "max_tokens": n_pen}, **kw, extra_body=extra)
        assert r.choices[0].text == ref.tokenizer.decode(want)
        assert want != plain_long  # the penalty changed something
    # stop_token_ids stops at a token; min_tokens holds the stop tokens back until then
    k = next(i for i in range(1, 6) if plain_ids[i] not in plain_ids[:i])
    stop = [plain_ids[k]]
    stopped = c.completions.create(**base, extra_body={"stop_token_ids": stop})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == k
    assert stopped.choices[0].text == ref.tokenizer.decode(plain_ids[:k])
    held = c.completions.create(**base, extra_body={"stop_token_ids": stop,
                                                    "min_tokens": k + 1})
    assert held.usage.completion_tokens >= k + 1


def _greedy_penalised(ref, prompt, n, freq=0.0, pres=0.0, rep=1.0):
    """Greedy tokens of the reference's logits after the penalties, as vLLM defines them."""
    seq = list(prompt)
    for _ in range(n):
        x = ref.logits(seq)[-1].float()
        gen = seq[len(prompt):]
        for t in set(gen):
            x[t] -= freq * gen.count(t) + pres
        if rep != 1.0:
            for t in set(seq):
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        seq.append(int(x.argmax()))
    return seq[len(prompt):]


@pytest.mark.slow
def test_tokenize_and_detokenize(server, ref):
    r = HTTP.post(server.url + "/tokenize", json={"prompt": "the cat sat"}).json()
    assert r["tokens"] == ref.tokenizer.encode("the cat sat") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    msgs = [{"role": "user", "content": "hi"}]
    r = HTTP.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == ref.tokenizer.encode_chat(msgs)
    d = HTTP.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == ref.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    bad = HTTP.post(server.url + "/detokenize", json={"tokens": [VOCAB]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    models = server.client.models.list().data
    assert models[0].model_extra["max_model_len"] == 512


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "logprobs": VOCAB + 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": -1}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": "a"}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "min_p": 0.1}, "min_p"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "verbosity": "low"}, "verbosity"),
    ({"prompt": "x", "store": True}, "store"),
    # tools with any template (its own tool format or the messages': test_server_tools.py),
    # but each must be a function tool with a name
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
      "function": {"name": "no spaces", "parameters": {"type": "object"}}}]},
     "tools[0].function.name"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_bad_values_are_refused_by_name(server, body, param):
    kind = "chat/completions" if "messages" in body else "completions"
    r = HTTP.post(f"{server.url}/v1/{kind}", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    json.dumps(r.json())


LM_EVAL_DOCS = [
    {"context": "the quick brown fox", "choices": [" jumps over the dog", " sleeps"], "label": 0},
    {"context": "once upon a time there was", "choices": [" a king", " nothing at all"],
     "label": 1},
]

LM_EVAL = textwrap.dedent("""
    import json, sys
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager
    url, tokenizer, tasks = sys.argv[1:4]
    # (the results' environment report runs `pip list` and more, ~1 s; nothing here reads it)
    lm_eval.evaluator.add_env_info = lambda results: None
    res = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url, "model": "llama", "tokenizer_backend": "huggingface",
                    "tokenizer": tokenizer, "max_retries": 1},
        tasks=["layersplit_ll"], num_fewshot=0, log_samples=True, torch_random_seed=None,
        task_manager=TaskManager(include_path=tasks, include_defaults=False))
    print(json.dumps([{"doc": s["doc_id"], "args": s["arguments"], "resps": s["resps"]}
                      for s in res["samples"]["layersplit_ll"]]))
""")


def _lm_eval_task(folder) -> None:
    folder.mkdir()
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    (folder / "layersplit_ll.yaml").write_text(textwrap.dedent(f"""
        task: layersplit_ll
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{label}}}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
    """))


@pytest.mark.slow
def test_lm_eval_loglikelihoods_are_the_models(server, ref, tiny_llama, tmp_path):
    """lm-evaluation-harness (`local-completions`: token ids, echo + logprobs) runs a
    loglikelihood task from local files (no hub) and gets the model's loglikelihoods."""
    _lm_eval_task(tmp_path / "tasks")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    # its own process: lm-eval and `datasets` read their offline settings at import
    proc = subprocess.run(
        [sys.executable, "-c", LM_EVAL, server.url + "/v1/completions", str(tiny_llama),
         str(tmp_path / "tasks")], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(s["doc"] for s in got) == [0, 1]
    items = [(LM_EVAL_DOCS[s["doc"]], arg, resp) for s in got
             for arg, resp in zip(s["args"], s["resps"], strict=True)]
    assert len(items) == 4  # a request per choice

    for doc, (context, continuation), ((ll, greedy),) in items:
        assert context == doc["context"] and continuation in doc["choices"]
        ctx = ref.tokenizer.encode(context)
        ids = ref.tokenizer.encode(context + continuation)
        assert ids[:len(ctx)] == ctx and len(ids) > len(ctx)
        lp = torch.log_softmax(ref.logits(ids).double(), dim=-1)
        rows = range(len(ctx) - 1, len(ids) - 1)  # row i predicts token i + 1
        want = sum(float(lp[i, ids[i + 1]]) for i in rows)
        assert ll == pytest.approx(want, abs=1e-4 * len(rows)), (context, continuation)
        assert greedy == all(int(lp[i].argmax()) == ids[i + 1] for i in rows)
