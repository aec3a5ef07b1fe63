"""OpenAI-compatible request bodies: parsing and validation, with errors that name the field.

Unsupported parameters are rejected (400) when they would change the output or promise what
is not done (`store`), and ignored when they would not (`user`, `metadata`, `service_tier`,
`prediction`, `prompt_cache_key`, `safety_identifier`), as OpenAI-compatible servers do; a
parameter this server does not know at all is rejected too, naming it (a misspelt `temprature`
must not be answered as if it had not been sent). Tool definitions and schemas are checked here
for their shape; whether a grammar can enforce them is the server's check, with the model's
tokenizer (`runtime.grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from layersplit.runtime.decoding import Decoding
from layersplit.shards.sampling_params import SamplingParams


class RequestError(ValueError):
    """A bad request; rendered as OpenAI's error JSON with `param` naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and the server's configuration bound a request by."""

    vocab: int = 1 << 31
    max_logprobs: int = 20  # top alternatives per token
    max_n: int = 8  # choices per request


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_text: str | None
    prompt_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    use_cache: bool
    speculative: bool | None
    n: int = 1
    decoding: Decoding | None = None  # logprobs and logits processors (None: none)
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output's
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's tool definitions
    tool_choice: str | dict = "auto"  # "none" | "auto" | "required" | {"type", "function"}
    parallel_tool_calls: bool = True
    json_schema: Any = None  # response_format's schema (json_object: {"type": "object"})

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[str] | None:
        """The functions the output must call (tool_choice required or named), else None."""
        if not self.tools or self.tool_choice in ("none", "auto"):
            return None
        if self.tool_choice == "required":
            return [t["function"]["name"] for t in self.tools]
        return [self.tool_choice["function"]["name"]]


def _finite(v: int | float, name: str) -> float:
    try:
        f = float(v)
    except OverflowError:
        raise RequestError(f"'{name}' is out of range", name) from None
    if f != f or f in (float("inf"), float("-inf")):
        raise RequestError(f"'{name}' must be a finite number", name)
    return f


def _get(body: dict, name: str, types: tuple, default: Any = None, allow_none: bool = True):
    if name not in body or (body[name] is None and allow_none):
        return default
    v = body[name]
    if isinstance(v, bool) and bool not in types:
        raise RequestError(f"'{name}' must be {' or '.join(t.__name__ for t in types)}", name)
    if not isinstance(v, types):
        raise RequestError(f"'{name}' must be {' or '.join(t.__name__ for t in types)}, "
                           f"got {type(v).__name__}", name)
    return v


_REJECT_IF = {  # parameter -> the value that is harmless (anything else is refused)
    "best_of": (None, 1), "suffix": (None, ""),
    # the deprecated forms of tools and tool_choice
    "functions": (None, []), "function_call": (None, "none"),
    # OpenAI's that would change the output and are not implemented
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,),
    # stored completions (for OpenAI's evals and distillation): nothing is stored here
    "store": (None, False),
    # vLLM's extensions that would change the output and are not implemented (structured
    # output: send response_format; prompt logprobs: echo + logprobs)
    "min_p": (None, 0, 0.0), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "bad_words": (None, []), "allowed_token_ids": (None,),
}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_IGNORED = ("user", "metadata", "service_tier", "prediction", "prompt_cache_key",
            "safety_identifier")  # OpenAI's that do not change the output
_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
             "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty",
             "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "repetition_penalty", "min_tokens", "stop_token_ids",
             "ignore_eos", "use_cache", "speculative", *_IGNORED, *_REJECT_IF)
FIELDS = {  # every top-level field each endpoint reads (or refuses by name)
    "completion": frozenset((*_SAMPLING, "prompt", "echo")),
    "chat": frozenset((*_SAMPLING, "messages", "max_completion_tokens")),
    "tokenize": frozenset(("model", "prompt", "add_special_tokens")),  # or a chat body
    "detokenize": frozenset(("model", "tokens")),
}
MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id",
                             # what OpenAI's client sends back of an assistant message
                             "refusal", "annotations", "audio", "function_call"))
_ROLES = ("system", "user", "assistant", "tool")


def check_fields(body: dict, kind: str, where: str = "") -> None:
    """RequestError naming the first field of `body` that endpoint `kind` does not know."""
    for name in body:
        if name not in FIELDS[kind]:
            what = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}.get(
                kind, f"/{kind}")
            raise RequestError(f"'{where}{name}' is not a parameter of {what} (docs/server.md "
                               "lists those this server takes)", f"{where}{name}")


def bad_text_field(value: Any, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON body that is not valid Unicode (a lone
    surrogate such as "\\ud800" is valid JSON, but no tokenizer or encoder takes it); None
    if every string is fine. Keys are checked as well as values."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if bad_text_field(k) is not None:  # a key itself: name the object that holds it
                return path or "body"
            found = bad_text_field(v, f"{path}.{k}" if path else k)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = bad_text_field(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def parse(body: Any, kind: str, served_model: str, limits: Limits = Limits()) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    bad = bad_text_field(body)
    if bad is not None:
        raise RequestError(f"'{bad}' holds a string that is not valid Unicode (a lone UTF-16 "
                           "surrogate escape such as \\ud800); send UTF-8 text", bad)
    check_fields(body, kind)
    for name, harmless in _REJECT_IF.items():
        if name in body and not any(type(body[name]) is type(h) and body[name] == h
                                    for h in harmless):  # (typed: best_of=true is not 1)
            if name == "response_format" and body[name] in ({"type": "text"},):
                continue
            raise RequestError(f"'{name}'={body[name]!r} is not supported by this server", name)
    model = _get(body, "model", (str,), served_model)
    if model != served_model:
        raise RequestError(f"the model '{model}' does not exist; this server serves "
                           f"'{served_model}'", "model", status=404, code="model_not_found")
    prompt_text = prompt_ids = messages = None
    if kind == "completion":
        if "prompt" not in body:
            raise RequestError("'prompt' is required", "prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            prompt_text = p
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
            prompt_ids = list(p)
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt "
                               "per request)", "prompt")
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty list", "messages")
        messages = [chat_message(m, i) for i, m in enumerate(msgs)]
    default_max = 16 if kind == "completion" else None
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",):
        value = _get(body, name, (int,), None)  # (chat: the second, when given, wins)
        if value is not None and value < 0:
            raise RequestError(f"'{name}' must be >= 0", name)
        if value is not None:
            max_tokens = min(value, (1 << 31) - 1)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else 1 << 30
    temperature = _finite(_get(body, "temperature", (int, float), 1.0), "temperature")
    if not 0 <= temperature <= 2:
        raise RequestError("'temperature' must be between 0 and 2", "temperature")
    top_p = _finite(_get(body, "top_p", (int, float), 1.0), "top_p")
    if not 0 < top_p <= 1:
        raise RequestError("'top_p' must be in (0, 1]", "top_p")
    top_k = _get(body, "top_k", (int,), 0)
    if (top_k < 0 and top_k != -1) or top_k >= 1 << 31:
        raise RequestError("'top_k' must be in 0..2**31-1 (0 or -1: off)", "top_k")
    seed = _get(body, "seed", (int,), None)
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise RequestError("'seed' must fit in 64 bits", "seed")
    if seed is not None and seed < 0:
        seed &= (1 << 63) - 1
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
        raise RequestError("'stop' must be a string or a list of up to 4 strings", "stop")
    if "" in stop:
        raise RequestError("'stop' holds an empty string (it would match everywhere)", "stop")
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    for key in opts:
        if key != "include_usage":
            raise RequestError(f"'stream_options.{key}' is not supported (include_usage is)",
                               f"stream_options.{key}")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a bool",
                           "stream_options.include_usage")
    use_cache = _get(body, "use_cache", (bool,), True)
    speculative = _get(body, "speculative", (bool,), None)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab
               for t in stop_ids):
        raise RequestError(f"'stop_token_ids' must be a list of token ids in 0..{limits.vocab - 1}",
                           "stop_token_ids")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                            top_k=max(top_k, 0), top_p=top_p, seed=seed, stop=tuple(stop),
                            stop_token_ids=tuple(stop_ids),
                            ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)))
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"'n' must be in 1..{limits.max_n} (this server's max_seqs)", "n")
    decoding, echo = _decoding(body, kind, limits, max_tokens)
    if prompt_ids is not None and any(not 0 <= t < limits.vocab for t in prompt_ids):
        raise RequestError(f"'prompt' holds a token id outside 0..{limits.vocab - 1}", "prompt")
    tools, choice, parallel = _tools(body, kind)
    schema = _response_format(body)
    if schema is not None and choice not in ("none", "auto") and tools:
        raise RequestError("'response_format' cannot constrain the output while 'tool_choice' "
                           "demands a tool call; send one of them", "response_format")
    return ParsedRequest(kind, model, prompt_text, prompt_ids, messages, params, stream,
                         include_usage, use_cache, speculative, n, decoding, echo, tools,
                         choice, parallel, schema)


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{where}[{j}]: only text parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}].text must be a string",
                                   f"{where}[{j}].text")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where} must be a string", where)
    return content


def chat_message(m: Any, i: int) -> dict[str, Any]:
    """One chat message as the template takes it: an assistant's tool calls with their
    arguments as objects (transformers' convention), a tool result with its call's id."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"{where} must be an object with a 'role'", where)
    role = m["role"]
    if role not in _ROLES:
        raise RequestError(f"{where}.role {role!r} is not one of {', '.join(_ROLES)}",
                           f"{where}.role")
    for key in m:
        if key not in MESSAGE_FIELDS:
            raise RequestError(f"'{where}.{key}' is not a field of a chat message",
                               f"{where}.{key}")
        if key in ("audio", "function_call") and m[key] is not None:
            raise RequestError(f"'{where}.{key}' is not supported", f"{where}.{key}")
    for key in ("name", "tool_call_id", "refusal"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
    calls = m.get("tool_calls")
    if calls and role != "assistant":
        raise RequestError(f"{where}.tool_calls: only assistant messages make tool calls",
                           f"{where}.tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out_calls = []
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{w} must be {{'type': 'function', 'function': {{'name', "
                                   "'arguments'}}}}", w)
            if c.get("id") is not None and not isinstance(c["id"], str):
                raise RequestError(f"{w}.id must be a string", f"{w}.id")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except ValueError:
                    raise RequestError(f"{w}.function.arguments is not valid JSON",
                                       f"{w}.function.arguments") from None
            if not isinstance(args, dict):
                raise RequestError(f"{w}.function.arguments must be a JSON object (or a string "
                                   "holding one)", f"{w}.function.arguments")
            out_calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
        content = m.get("content")
        return {"role": role, "content": "" if content is None else
                _text_content(content, f"{where}.content"), "tool_calls": out_calls}
    msg = {"role": role, "content": _text_content(m.get("content"), f"{where}.content")}
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
    return msg


def _tools(body: dict, kind: str) -> tuple[list[dict] | None, str | dict, bool]:
    tools = _get(body, "tools", (list,), None)
    choice = body.get("tool_choice")
    parallel = _get(body, "parallel_tool_calls", (bool,), True)
    if kind != "chat":
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise RequestError(f"'{name}' is a chat parameter", name)
        return None, "none", parallel
    names = []
    for i, t in enumerate(tools or []):
        w = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"{w} must be {{'type': 'function', 'function': {{...}}}} (only "
                               "function tools are supported)", w)
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise RequestError(f"{w}.function.name must be 1-64 letters, digits, '_' or '-'",
                               f"{w}.function.name")
        if fn["name"] in names:
            raise RequestError(f"{w}.function.name {fn['name']!r} is given twice",
                               f"{w}.function.name")
        names.append(fn["name"])
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RequestError(f"{w}.function.parameters must be a JSON Schema object",
                               f"{w}.function.parameters")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise RequestError("'tool_choice' must be none, auto, required or {'type': "
                               "'function', 'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in names:
            raise RequestError(f"'tool_choice' names the function {fn['name']!r}, which is "
                               "not in 'tools'", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise RequestError("'tool_choice' must be none, auto, required or {'type': "
                           "'function', 'function': {'name': ...}}", "tool_choice")
    elif choice in ("auto", "required") and not tools:
        raise RequestError(f"'tool_choice' is {choice!r} but no 'tools' are given",
                           "tool_choice")
    return (tools or None), choice, parallel


def _response_format(body: dict) -> Any:
    """The JSON schema the output must follow (None: free text)."""
    rf = _get(body, "response_format", (dict,), None)
    if rf is None or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return {"type": "object"}
    if rf.get("type") == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise RequestError("'response_format.json_schema' must be {'name': ..., "
                               "'schema': {...}, 'strict': ...}", "response_format")
        return js.get("schema", {})
    raise RequestError(f"'response_format' type {rf.get('type')!r} is not supported (text, "
                       "json_object, json_schema)", "response_format")


def _penalty(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = _finite(_get(body, name, (int, float), default), name)
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be in [{lo}, {hi}]", name)
    return v


def _decoding(body: dict, kind: str, limits: Limits,
              max_tokens: int) -> tuple[Decoding | None, bool]:
    """The request's logprobs and logits processors (None: it asks for none), and `echo`."""
    k_max = limits.max_logprobs
    logprobs = prompt_lp = None
    echo = False
    if kind == "chat":
        if _get(body, "logprobs", (bool,), False):
            logprobs = _get(body, "top_logprobs", (int,), 0)
            if not 0 <= logprobs <= k_max:
                raise RequestError(f"'top_logprobs' must be in 0..{k_max}", "top_logprobs")
        elif body.get("top_logprobs") not in (None, 0):
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = _get(body, "logprobs", (int,), None)
        if logprobs is not None and not 0 <= logprobs <= k_max:
            raise RequestError(f"'logprobs' must be in 0..{k_max}", "logprobs")
        if "top_logprobs" in body and body["top_logprobs"] is not None:
            raise RequestError("'top_logprobs' is a chat parameter; completions take "
                               "'logprobs': N", "top_logprobs")
        echo = _get(body, "echo", (bool,), False)
        if echo and logprobs is not None:
            prompt_lp = logprobs
    presence = _penalty(body, "presence_penalty", -2.0, 2.0, 0.0)
    frequency = _penalty(body, "frequency_penalty", -2.0, 2.0, 0.0)
    repetition = _finite(_get(body, "repetition_penalty", (int, float), 1.0),
                         "repetition_penalty")
    if not 0 < repetition <= 100:
        raise RequestError("'repetition_penalty' must be in (0, 100] (1: off)",
                           "repetition_penalty")
    raw_bias = _get(body, "logit_bias", (dict,), {})
    bias = []
    for key, v in raw_bias.items():
        try:
            t = int(key)
        except ValueError:
            t = -1
        if not 0 <= t < limits.vocab:
            raise RequestError(f"'logit_bias' key {key!r} is not a token id in "
                               f"0..{limits.vocab - 1}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias' value {v!r} of token {key} must be a number in "
                               "[-100, 100]", "logit_bias")
        bias.append((t, float(v)))
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if not 0 <= min_tokens <= max_tokens:
        raise RequestError("'min_tokens' must be in 0..max_tokens", "min_tokens")
    d = Decoding(logprobs=logprobs, prompt_logprobs=prompt_lp, presence_penalty=presence,
                 frequency_penalty=frequency, repetition_penalty=repetition,
                 logit_bias=tuple(sorted(bias)), min_tokens=min_tokens)
    return (d if d != Decoding() else None), echo
