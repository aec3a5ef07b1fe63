"""Tool calls and structured output on the real server, through the official `openai` client:
the bundled Hermes-style template (Qwen2.5's, `--chat-template`), tool_choice required / named
enforced by the grammar, the round trip call -> tool result -> answer, response_format
json_schema validated with `jsonschema`; schemas that cannot be compiled refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import shard_children
from tests.launch.test_server import HTTP, Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")  # (the `server` extra installs both)
MODEL = "llama"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a zone",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "templates" / "chatml-tools.jinja"


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The tiny model (ChatML, as the default model) with the bundled Hermes-style template."""
    s = Server(tiny_llama, "--max-context", "2048", "--chat-template", str(TEMPLATE))
    yield s
    assert s.stop() == 0
    assert shard_children() == []


def _check_call(call, tool) -> dict:
    assert call.type == "function" and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def _streamed(chunks) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat answer."""
    text, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(server, tiny_llama, stream):
    c = server.client
    kw = dict(model=MODEL, tools=[WEATHER, CLOCK], temperature=0, max_tokens=120)
    # one call (a random model allowed several may repeat them until max_tokens)
    one = dict(tool_choice="required", parallel_tool_calls=False)
    if stream:
        _, calls, finish = _streamed(c.chat.completions.create(
            messages=USER, stream=True, **one, **kw))
        assert finish == "tool_calls" and len(calls) >= 1
        call = calls[0]
        name, arguments, cid = call["name"], call["arguments"], call["id"]
    else:
        r = c.chat.completions.create(messages=USER, **one, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        name, arguments, cid = call.function.name, call.function.arguments, call.id
    tool = next(t for t in (WEATHER, CLOCK) if t["function"]["name"] == name)
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    convo = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name,
                                                          "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": cid, "content": '{"temperature": 21}'}]
    kw["max_tokens"] = 6
    if stream:
        text, calls, finish = _streamed(c.chat.completions.create(
            messages=convo, tool_choice="none", stream=True,
            stream_options={"include_usage": True}, **kw))
    else:
        r = c.chat.completions.create(messages=convo, tool_choice="none", **kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert isinstance(text, str) and finish in ("stop", "length")
    # the conversation went through the template as transformers renders it
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(tiny_llama)
    want = tk.apply_chat_template(
        USER + [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "content": '{"temperature": 21}'}],
        tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=False,
        chat_template=TEMPLATE.read_text())
    got = HTTP.post(server.url + "/tokenize", json={"messages": convo,
                                                     "tools": [WEATHER, CLOCK]}).json()
    assert got["tokens"] == tk(want, add_special_tokens=False)["input_ids"]
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in want


@pytest.mark.slow
def test_named_tool_choice_always_yields_a_valid_call(server):
    c = server.client
    for seed in range(3):
        r = c.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, CLOCK], temperature=1.0, seed=seed,
            max_tokens=120, tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        _check_call(calls[0], CLOCK)


# as pydantic writes a model's schema: the nested model under $defs, referred to from the root
BOOKING = {"type": "function", "function": {
    "name": "book", "description": "book a table",
    "parameters": {"type": "object", "properties": {
        "place": {"$ref": "#/$defs/Place"}, "default": {"$ref": "#/$defs/Place"}},
        "required": ["place", "default"], "additionalProperties": False,
        "$defs": {"Place": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 4}},
            "required": ["city"], "additionalProperties": False}}}}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "book"}}])
def test_forced_call_of_a_tool_whose_parameters_refer_to_their_own_defs(server, choice):
    """Local references ("#/$defs/...") in a tool's parameters resolve from the parameters'
    root, not from the grammar's wrapper around them."""
    r = server.client.chat.completions.create(
        model=MODEL, messages=USER, tools=[BOOKING], tool_choice=choice, temperature=0,
        max_tokens=200, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_call(calls[0], BOOKING)


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 8},
            "number": {"type": "integer", "minimum": 1, "maximum": 999}},
            "required": ["street", "number"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "x": {"type": "number", "multipleOf": 0.25, "minimum": -10, "maximum": 10},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 50}},
     "required": ["x", "ok", "n"], "additionalProperties": False},
]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_responses_validate(server, temperature):
    c = server.client
    for i, schema in enumerate(SCHEMAS):
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "describe it"}],
            temperature=temperature, seed=i, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # any object: a random model's keys may run on past max_tokens (then cut, as OpenAI's)
    r = c.completions.create(model=MODEL, prompt="a JSON object:", max_tokens=60,
                             temperature=temperature, seed=5,
                             extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    # valid JSON Schemas the grammar cannot compile: a look-around, an unimplemented keyword
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)y"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_and_schemas_are_refused_by_name(server, body, param):
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"]  # the message names the field too


@pytest.fixture(scope="module")
def plain_server(tiny_llama):
    """The tiny model with its own ChatML template, which writes no tool calls (as the default
    model's): tools go into the messages in the Hermes format."""
    s = Server(tiny_llama, "--max-context", "2048")
    yield s
    kids = shard_children(s.proc.pid)  # (the module's other server is still up: not these)
    assert kids and s.stop() == 0
    assert not [k for k in kids if k.is_running() and k.status() != "zombie"]


@pytest.mark.slow
def test_a_template_without_tools_renders_them_as_qwen_does(plain_server, tiny_llama):
    """The conversation with tools, a call and its result reaches the model as the Hermes
    template (Qwen2.5's) would have written it, token for token."""
    from transformers import AutoTokenizer

    args = {"city": "Paris", "unit": "celsius"}
    convo = [{"role": "system", "content": "Be brief."}, *USER,
             {"role": "assistant", "content": "Let me look.", "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'},
             {"role": "tool", "tool_call_id": "c2", "content": '{"wind": 3}'}]
    tk = AutoTokenizer.from_pretrained(tiny_llama)
    want = tk.apply_chat_template(
        [*convo[:2], {**convo[2], "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
         *convo[3:]],
        tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=False,
        chat_template=TEMPLATE.read_text())
    got = HTTP.post(plain_server.url + "/tokenize",
                     json={"messages": convo, "tools": [WEATHER, CLOCK]}).json()
    assert got["tokens"] == tk(want, add_special_tokens=False)["input_ids"]
    assert "<tools>" in want and "<tool_response>\n{\"wind\": 3}\n</tool_response>" in want


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("template", ["hermes", "without tools"])
def test_forced_and_required_tool_calls(request, template, stream):
    """tool_choice required and named, streamed and not, with the Hermes-style template and
    with a template that writes no tool calls (as the default model's)."""
    c = request.getfixturevalue("server" if template == "hermes" else "plain_server").client
    for choice, tool in (("required", None),
                         ({"type": "function", "function": {"name": "get_time"}}, CLOCK)):
        kw = dict(model=MODEL, messages=USER, tools=[WEATHER, CLOCK], temperature=1.0, seed=4,
                  max_tokens=120, tool_choice=choice, parallel_tool_calls=False)
        if stream:
            _, calls, finish = _streamed(c.chat.completions.create(stream=True, **kw))
            got = [(x["name"], x["arguments"]) for x in calls]
        else:
            r = c.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            got = [(x.function.name, x.function.arguments)
                   for x in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and len(got) == 1
        name, arguments = got[0]
        want = tool or next(t for t in (WEATHER, CLOCK) if t["function"]["name"] == name)
        assert name == want["function"]["name"]
        jsonschema.validate(json.loads(arguments), want["function"]["parameters"])


@pytest.fixture(scope="module")
def default_server(default_model):
    """The default model with its own template (ChatML with a default system prompt, no tool
    format): tools go into its system prompt in the Hermes format."""
    s = Server(default_model, "--max-context", "2048")
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_forced_and_required_tool_calls_with_the_default_model(default_server):
    """A `required` tool call (not streamed) and a named one (streamed) at temperature 1.0 are
    valid calls of a tool the request offered, with the default model. (~20 s on 2 cores: the
    model's 30 layers and llguidance's view of its 49,152 tokens.)"""
    c = default_server.client
    kw = dict(model=c.models.list().data[0].id, messages=USER, tools=[WEATHER, CLOCK],
              temperature=1.0, seed=4, max_tokens=80, parallel_tool_calls=False)
    r = c.chat.completions.create(tool_choice="required", **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    name = calls[0].function.name
    _check_call(calls[0], next(t for t in (WEATHER, CLOCK) if t["function"]["name"] == name))
    _, calls, finish = _streamed(c.chat.completions.create(
        stream=True, tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw))
    assert finish == "tool_calls" and [x["name"] for x in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK["function"]["parameters"])
