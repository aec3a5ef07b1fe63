"""Bad HTTP bodies for the server's endpoints, generated with hypothesis.

Each case starts from a valid body of one endpoint (with some valid optional fields drawn) and
makes it invalid in one way whose error is known: a field of a wrong type, a required field
missing, a number far out of range, a field replaced by nested junk, a body nested past the
parser's depth, bytes that are not UTF-8, a lone surrogate escape in a value or key, bytes that
are not a JSON object (or JSON cut short), a body over the server's `max_body_mb` (with a
Content-Length or chunked), an unknown field at the top or in a chat message, a model the
server does not serve. `Case.status` and `Case.param` say the answer it must get.

Used by `tests/launch/test_server.py` (a few hundred cases against the test server) and
`bench/http_fuzz.py` (the campaign, with counts per mutation).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator

import httpx
from hypothesis import assume
from hypothesis import strategies as st
from layersplit.runtime.openai_api import FIELDS, MESSAGE_FIELDS

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
KIND = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
        "/tokenize": "tokenize", "/detokenize": "detokenize"}


@dataclasses.dataclass
class Case:
    path: str
    body: bytes
    status: int  # the status it must get
    params: tuple[str | None, ...]  # `param` of the error must be one of these, or under one
    mutation: str
    chunked: bool = False  # sent without a Content-Length

    def send(self, url: str, timeout: float = 30, client=httpx) -> httpx.Response:
        """POST it (`client`: an `httpx.Client`, or the module's own functions)."""
        content = _chunks(self.body) if self.chunked else self.body
        return client.post(url + self.path, content=content, timeout=timeout,
                           headers={"content-type": "application/json"})


def _chunks(body: bytes) -> Iterator[bytes]:
    for i in range(0, len(body), 1 << 16):
        yield body[i:i + 1 << 16]


def check_answer(case: Case, r: httpx.Response) -> str | None:
    """What is wrong with the server's answer to `case` (None: it is right)."""
    if r.status_code != case.status:
        return f"status {r.status_code}, want {case.status}: {r.text[:300]}"
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error JSON: {r.text[:300]}"
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
        return f"no error message: {r.text[:300]}"
    param = err.get("param")
    if not any(param == p or (p is not None and isinstance(param, str) and
                              param.startswith((p + ".", p + "[")))
               for p in case.params):
        return f"param {param!r}, want one of {case.params}: {err['message']}"
    return None


# ---- valid bodies ----------------------------------------------------------------------------
_OPTIONAL = {  # a valid value of each optional field, for both generation endpoints
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["zz"], "n": 1,
    "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
    "logit_bias": {"5": 1.0}, "min_tokens": 0, "stop_token_ids": [3], "ignore_eos": True,
    "use_cache": True, "speculative": False, "stream": False, "user": "u",
}
_OPTIONAL_OF = {"completion": {"echo": False, "logprobs": 2},
                "chat": {"logprobs": True, "max_completion_tokens": 1}}


@st.composite
def valid_bodies(draw, path: str, model: str) -> dict:
    kind = KIND[path]
    if kind == "detokenize":
        return {"tokens": draw(st.lists(st.integers(0, 100), max_size=4))}
    messages = [{"role": "user", "content": "hello"}]
    if draw(st.booleans()):
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": "be brief"}]})
    if kind == "tokenize":
        return {"messages": messages} if draw(st.booleans()) else {"prompt": "hello"}
    body: dict = {"model": model, "max_tokens": 1}
    body.update({"prompt": "hello"} if kind == "completion" else {"messages": messages})
    optional = {**_OPTIONAL, **_OPTIONAL_OF[kind]}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        body[name] = copy.deepcopy(optional[name])  # (mutations change it in place)
    if kind == "chat" and body.get("logprobs") and draw(st.booleans()):
        body["top_logprobs"] = 2
    return body


def _not_int(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return True
    return False


# ---- what makes each field invalid -----------------------------------------------------------
_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                          st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
JUNK = st.recursive(_JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=6), inner, min_size=1, max_size=3)), max_leaves=12)
_STR = st.text(max_size=8)
_CONTAINERS = st.one_of(st.lists(_JSON_SCALARS, min_size=1, max_size=3),
                        st.dictionaries(_STR, _JSON_SCALARS, min_size=1, max_size=3))
_NUMBER_WRONG = st.one_of(_STR, st.booleans(), _CONTAINERS)  # for int | float fields
_INT_WRONG = st.one_of(_NUMBER_WRONG, st.sampled_from([0.5, 1.5, -2.25, 1e3]))
_BOOL_WRONG = st.one_of(st.integers(), _STR, _CONTAINERS, st.floats(allow_nan=False))
WRONG_TYPE = {  # field -> values of a wrong type for it (None is the default for most)
    "model": st.one_of(st.integers(), st.booleans(), _CONTAINERS),
    "max_tokens": _INT_WRONG, "top_k": _INT_WRONG, "seed": _INT_WRONG, "n": _INT_WRONG,
    "min_tokens": _INT_WRONG,
    "temperature": _NUMBER_WRONG, "top_p": _NUMBER_WRONG, "presence_penalty": _NUMBER_WRONG,
    "frequency_penalty": _NUMBER_WRONG, "repetition_penalty": _NUMBER_WRONG,
    "stream": _BOOL_WRONG, "ignore_eos": _BOOL_WRONG, "use_cache": _BOOL_WRONG,
    "speculative": _BOOL_WRONG,
    "stop": st.one_of(st.integers(), st.booleans(), st.dictionaries(_STR, _JSON_SCALARS,
                                                                    min_size=1, max_size=2),
                      st.lists(st.integers(), min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), min_size=5, max_size=6),
                      st.just([""])),
    "stop_token_ids": st.one_of(_STR, st.integers(), st.dictionaries(_STR, _JSON_SCALARS,
                                                                    min_size=1, max_size=2),
                                st.lists(_STR, min_size=1, max_size=3),
                                st.lists(st.integers(max_value=-1), min_size=1, max_size=3)),
    "logit_bias": st.one_of(_STR, st.integers(), st.lists(_JSON_SCALARS, min_size=1),
                            st.dictionaries(st.text(min_size=1, max_size=4).filter(_not_int),
                                st.integers(-5, 5), min_size=1, max_size=2),
                            st.dictionaries(st.just("5"), st.one_of(_STR, st.booleans()),
                                            min_size=1)),
    "stream_options": st.one_of(_STR, st.integers(), st.lists(_JSON_SCALARS, min_size=1),
                                st.fixed_dictionaries({"include_usage": st.one_of(
                                    st.integers(), _STR, _CONTAINERS)}),
                                st.dictionaries(_STR.filter(lambda k: k != "include_usage"),
                                                _JSON_SCALARS, min_size=1, max_size=2)),
    "response_format": st.one_of(_STR, st.integers(), st.lists(_JSON_SCALARS, min_size=1),
                                 st.fixed_dictionaries({"type": _STR.filter(
                                     lambda t: t not in ("text", "json_object",
                                                         "json_schema"))})),
}
WRONG_TYPE_OF = {
    "completion": {
        "prompt": st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False),
                            st.dictionaries(_STR, _JSON_SCALARS, max_size=2),
                            st.lists(_STR, min_size=2, max_size=3),
                            st.lists(st.one_of(st.floats(), st.booleans(), st.none()),
                                     min_size=1, max_size=3)),
        "logprobs": _INT_WRONG, "echo": _BOOL_WRONG,
    },
    "chat": {
        "messages": st.one_of(st.integers(), _STR, st.just([]),
                              st.dictionaries(_STR, _JSON_SCALARS, max_size=2),
                              st.lists(st.one_of(_JSON_SCALARS, st.lists(_JSON_SCALARS)),
                                       min_size=1, max_size=3)),
        "logprobs": _BOOL_WRONG, "max_completion_tokens": _INT_WRONG,
    },
    "tokenize": {"prompt": st.one_of(st.integers(), st.booleans(), _CONTAINERS)},
    "detokenize": {"tokens": st.one_of(_STR, st.integers(), st.dictionaries(
        _STR, _JSON_SCALARS, max_size=2), st.lists(st.one_of(
            _STR, st.floats(), st.booleans(), st.none(), st.integers(max_value=-1)),
            min_size=1, max_size=3))},
}
# message fields: a wrong type of each, with the param it must be named by
MESSAGE_WRONG = {
    "role": st.one_of(st.integers(), st.none(), _CONTAINERS, _STR.filter(
        lambda r: r not in ("system", "user", "assistant", "tool"))),
    "content": st.one_of(st.integers(), st.booleans(), st.none(),
                         st.dictionaries(_STR, _JSON_SCALARS, max_size=2),
                         st.lists(_JSON_SCALARS, min_size=1, max_size=2),
                         st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(
                             st.integers(), st.none(), _CONTAINERS)}), min_size=1, max_size=2),
                         st.lists(st.fixed_dictionaries({"type": _STR.filter(
                             lambda t: t != "text"), "text": _STR}), min_size=1, max_size=2)),
    "name": st.one_of(st.integers(), _CONTAINERS),
    "tool_calls": st.one_of(st.lists(st.fixed_dictionaries({
        "type": st.just("function"), "function": st.fixed_dictionaries({
            "name": st.just("f"), "arguments": _STR.map(lambda s: "{" + s)})}),
        min_size=1, max_size=1)),
}
HUGE = {  # field -> (how far out of range, as JSON text)
    "temperature": ("1e{}", "-1e{}"), "top_p": ("1e{}", "-1e{}"),
    "presence_penalty": ("1e{}", "-1e{}"), "frequency_penalty": ("1e{}", "-1e{}"),
    "repetition_penalty": ("1e{}", "-1e{}"), "top_k": ("1{:0>{}}", "-1{:0>{}}"),
    "seed": ("1{:0>{}}", "-1{:0>{}}"), "n": ("1{:0>{}}", "-1{:0>{}}"),
    "min_tokens": ("1{:0>{}}", "-1{:0>{}}"), "max_tokens": ("-1{:0>{}}",),
}
HUGE_OF = {"completion": {"logprobs": ("1{:0>{}}", "-1{:0>{}}")},
           "chat": {"max_completion_tokens": ("-1{:0>{}}",)}}
KNOWN = frozenset().union(*FIELDS.values())  # a key none of the endpoints takes is unknown
_CONTAINER_FIELDS = {"prompt", "messages", "stop", "stop_token_ids", "tokens", "logit_bias",
                     "stream_options", "response_format"}
_BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3(", b"\x80", b"\xe2\x28\xa1", b"\xf8\x88\x80\x80\x80",
             b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe0\x80\xaf"]


def _required(kind: str) -> str:
    return {"completion": "prompt", "chat": "messages", "tokenize": "prompt",
            "detokenize": "tokens"}[kind]


def _text_paths(body: dict, kind: str) -> list[tuple[list, str]]:
    """(path of keys into body, the param that names it) of each text value a surrogate can
    go into."""
    out: list[tuple[list, str]] = []
    if isinstance(body.get("prompt"), str):
        out.append((["prompt"], "prompt"))
    for i, m in enumerate(body.get("messages") or []):
        if isinstance(m["content"], str):
            out.append((["messages", i, "content"], f"messages[{i}].content"))
        else:
            out.append((["messages", i, "content", 0, "text"], f"messages[{i}].content[0].text"))
    if isinstance(body.get("model"), str):
        out.append((["model"], "model"))
    if body.get("stop"):
        out.append((["stop", 0], "stop[0]"))
    if body.get("user"):
        out.append((["user"], "user"))
    return out


def _set(body: dict, path: list, value) -> None:
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _dumps(body) -> bytes:
    return json.dumps(body).encode()


@st.composite
def cases(draw, model: str, max_body: int) -> Case:
    """One invalid body for one endpoint and the answer it must get."""
    path = draw(st.sampled_from(ENDPOINTS))
    kind = KIND[path]
    body = draw(valid_bodies(path, model))
    mutations = ["wrong_type", "missing", "junk", "deep", "bad_utf8", "surrogate", "not_json",
                 "cut", "oversized", "unknown_field", "wrong_model"]
    if kind in ("completion", "chat"):
        mutations.append("huge")
    if kind == "chat":
        mutations.append("message_field")
    mutation = draw(st.sampled_from(mutations))
    status, params = 400, (None,)
    raw: bytes | None = None
    if mutation in ("wrong_type", "junk"):
        table = {**(WRONG_TYPE if kind in ("completion", "chat") else {}), **WRONG_TYPE_OF[kind]}
        if kind == "tokenize" and "messages" in body:
            table = {"messages": WRONG_TYPE_OF["chat"]["messages"]}
        if mutation == "junk":  # a container of anything where a scalar goes
            table = {f: v for f, v in table.items() if f not in _CONTAINER_FIELDS}
            assume(table)
        field = draw(st.sampled_from(sorted(table)))
        if mutation == "junk":
            value = draw(JUNK.filter(lambda v: isinstance(v, (list, dict))))
        else:
            value = draw(table[field])
        body[field] = value
        params = (field,)
        if field == "messages" and kind == "tokenize":
            params = ("messages",)
    elif mutation == "missing":
        body.pop(_required(kind), None)
        if kind == "tokenize":
            body.pop("messages", None)
        params = (_required(kind),)
    elif mutation == "huge":
        table = {**HUGE, **HUGE_OF[kind]}
        field = draw(st.sampled_from(sorted(table)))
        form = draw(st.sampled_from(table[field]))
        digits = draw(st.integers(20, 400))
        text = form.format(digits) if "e" in form else form.format("", digits)
        body[field] = "@@"
        raw = _dumps(body).replace(b'"@@"', text.encode())
        params = (field,)
    elif mutation == "wrong_model":
        body["model"] = draw(_STR.filter(lambda m: m != model and m.encode("utf-8", "ignore")
                                         .decode() == m))
        status, params = 404, ("model",)
    elif mutation == "message_field":
        i = draw(st.integers(0, len(body["messages"]) - 1))
        field = draw(st.sampled_from(sorted(MESSAGE_WRONG)))
        body["messages"][i][field] = draw(MESSAGE_WRONG[field])
        params = (f"messages[{i}]",)
    elif mutation == "deep":
        depth = draw(st.integers(2000, max(2000, min(20000, (max_body - 512) // 12))))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        body[_required(kind)] = "@@"
        raw = _dumps(body).replace(b'"@@"', (opener * depth + "1" + closer * depth).encode())
    elif mutation == "bad_utf8":
        paths = _text_paths(body, kind)
        assume(paths)
        where, param = draw(st.sampled_from(paths))
        bad = draw(st.sampled_from(_BAD_UTF8))
        _set(body, where, "@@")
        raw = _dumps(body).replace(b"@@", b"a" + bad + b"b")
        params = (None, param)  # a decode error, or (surrogates) the field
    elif mutation == "surrogate":
        paths = [*_text_paths(body, kind), (None, "body")]
        where, param = draw(st.sampled_from(paths))
        code = draw(st.integers(0xD800, 0xDFFF))
        escape = f"\\u{code:04x}".encode()
        if where is None:  # a key
            body["@@"] = 1
        else:
            _set(body, where, "@@")
        raw = _dumps(body).replace(b"@@", b"x" + escape)
        params = (param,)
    elif mutation == "not_json":
        raw = draw(st.one_of(st.binary(max_size=64), st.text(max_size=32).map(
            lambda t: t.encode("utf-8", "surrogatepass")), st.sampled_from(
                [b"null", b"[]", b"[1, 2]", b'"text"', b"3", b"true", b"", b" "])))
        try:
            assume(not isinstance(json.loads(raw), dict))
        except ValueError:
            pass
    elif mutation == "cut":
        full = _dumps(body)
        raw = full[:draw(st.integers(0, len(full) - 1))]
    elif mutation == "oversized":
        size = draw(st.integers(max_body + 1, max_body + 4096))
        body["pad"] = "@@"
        raw = _dumps(body).replace(b"@@", b"a" * size)
        status = 413
    elif mutation == "unknown_field":
        if kind == "chat" and draw(st.booleans()):
            i = draw(st.integers(0, len(body["messages"]) - 1))
            key = draw(st.text(min_size=1, max_size=10).filter(
                lambda k: k not in MESSAGE_FIELDS))
            body["messages"][i][key] = draw(JUNK)
            params = (f"messages[{i}].{key}",)
        else:
            key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN))
            body[key] = draw(JUNK)
            params = (key,)
    raw = raw if raw is not None else _dumps(body)
    chunked = mutation == "oversized" and draw(st.booleans())
    return Case(path, raw, status, params, mutation, chunked)
