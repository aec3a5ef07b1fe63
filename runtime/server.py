"""`layersplit serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the runtime.

One engine thread owns the coordinator (its sockets are used from that thread only) and runs
every request in one continuous batch (`runtime.batching`): new requests join between steps,
finished ones leave at once; HTTP handlers talk to it through thread-safe queues. A client
that disconnects cancels its request at the next step. A shard failure fails the requests in
flight with 503, `/health` reports it, and the shard group is restarted (or the server exits,
with `restart_on_failure = false`).

This module is the HTTP side: the FastAPI app, request checks, and the rendering of each
response (`Output`); the engine thread is `runtime.engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.decoding import Decoding
from layersplit.runtime.engine import Engine, Job
from layersplit.runtime.metrics import Metrics
from layersplit.runtime.openai_api import (
    Limits,
    ParsedRequest,
    RequestError,
    bad_text_field,
    check_fields,
    parse,
)
from layersplit.runtime.openai_render import Renderer, usage
from layersplit.runtime.tool_calls import ToolCallStream
from layersplit.runtime.turns import assistant_message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("layersplit.server")


def _error(e: RequestError) -> Response:
    # ensure_ascii: a message that quotes the client's text may hold a lone surrogate, which
    # JSONResponse's UTF-8 rendering cannot encode
    return Response(json.dumps(e.body(), ensure_ascii=True), status_code=e.status,
                    media_type="application/json")


def create_app(config: RuntimeConfig) -> FastAPI:
    metrics = Metrics()
    engine = Engine(config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, config.grace_s)

    app = FastAPI(title="layersplit", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        path = request.url.path
        if config.api_key and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {config.api_key}".encode()):
                resp = _error(RequestError("invalid or missing API key (Authorization: Bearer "
                                           "...)", None, status=401,
                                           type_="authentication_error"))
                metrics.requests.labels(path, "401").inc()
                return resp
        response = await call_next(request)
        if path.startswith("/v1/"):
            metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": engine.status}
        if engine.reason:
            body["reason"] = engine.reason
        coord = engine.coord
        if coord is not None:
            body["speculation"] = (f"on ({coord.draft_info.get('kind')} draft)"
                                   if coord.draft is not None else
                                   f"off: {coord.draft_down}" if coord.draft_down else "off")
        return JSONResponse(body, status_code=200 if engine.status == "ready" else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": engine.served_model, "object": "model", "created": int(time.time()),
            "owned_by": "layersplit", "max_model_len": config.max_context,
            "dtype": engine.coord.dtype if engine.coord is not None else None}]})

    body_limit = int(config.max_body_mb * 2**20)

    def limits() -> Limits:
        vocab = (engine.coord.model_config.vocab_size if engine.coord is not None
                 else Limits.vocab)
        return Limits(vocab=vocab, max_logprobs=config.max_logprobs, max_n=config.max_seqs)

    async def handle(request: Request, kind: str):
        arrived = time.perf_counter()
        try:
            body = await _json_body(request, body_limit)
            req = parse(body, kind, engine.served_model, limits())
            loop = asyncio.get_running_loop()
            # (compiling a grammar may take a while: not on the event loop, which streams)
            await loop.run_in_executor(None, _constrain, engine, req)
            job = Job(req, loop, asyncio.Queue(), arrived)
            job.marks["parsed"] = time.perf_counter()
            engine.submit(job)
        except RequestError as e:
            return _error(e)
        out = Output(job, kind, engine.served_model, Renderer(engine.tokenizer))
        headers = {}
        coord = engine.coord
        if (req.decoding is not None and req.decoding.processes and req.speculative is not False
                and coord is not None and coord.draft is not None):
            # (the request would have speculated: say why it does not)
            headers["X-Layersplit-Speculation"] = "off: " + ", ".join(req.decoding.processors)
        if req.stream:
            return StreamingResponse(out.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        try:
            while not out.finished:
                kind_, payload = await _next(job, request)
                if kind_ == "error":
                    status, err = payload
                    return _error(err if isinstance(err, RequestError) else RequestError(
                        str(err), None, status=status, type_="service_unavailable"
                        if status == 503 else "server_error"))
                if kind_ == "disconnected":
                    return Response(status_code=499)
                out.take(kind_, *payload)
            return JSONResponse(out.final(), headers=headers)
        finally:
            job.cancelled = True

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await _json_body(request, body_limit)
            tok = _tokenizer_of(engine)
            loop = asyncio.get_running_loop()  # (tokenizing is not for the event loop)
            if "messages" in body:
                req = parse(body, "chat", engine.served_model, limits())
                try:
                    ids = await loop.run_in_executor(
                        None, functools.partial(tok.encode_chat, req.messages, tools=req.tools))
                except jinja2.exceptions.TemplateError as e:
                    raise RequestError(f"the chat template refused the messages: {e}",
                                       "messages") from None
            else:
                check_fields(body, "tokenize")
                _check_model(body, engine.served_model)
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise RequestError("'prompt' (a string) or 'messages' is required",
                                       "prompt")
                add = _get_bool(body, "add_special_tokens", True)
                ids = await loop.run_in_executor(
                    None, functools.partial(tok.encode, prompt, add_special_tokens=add))
        except RequestError as e:
            return _error(e)
        return JSONResponse({"count": len(ids), "max_model_len": config.max_context,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await _json_body(request, body_limit)
            check_fields(body, "detokenize")
            _check_model(body, engine.served_model)
            tok = _tokenizer_of(engine)
            ids = body.get("tokens")
            vocab = limits().vocab
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                    for t in ids):
                raise RequestError(f"'tokens' must be a list of token ids in 0..{vocab - 1}",
                                   "tokens")
        except RequestError as e:
            return _error(e)
        return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    return app


def _constrain(engine: Engine, req: ParsedRequest) -> None:
    """Check a request's tools against the model's template and compile the grammar its
    response_format or tool_choice asks for (`runtime.grammar`); RequestError naming the field
    when one cannot be."""
    if engine.status != "ready":
        return  # (refused with 503 when it is submitted)
    if req.tools and (engine.tokenizer is None or not engine.tokenizer.chat_template):
        raise RequestError(f"{engine.served_model} has no chat template, so it takes no "
                           "tools", "tools")
    if not req.tools and req.json_schema is None:
        return
    # (imported here, not for every request: llguidance's import takes seconds the first time)
    from layersplit.runtime.grammar import GrammarError, tool_call_grammar

    comp = engine.grammars()
    for i, t in enumerate(req.tools or []):
        params = t["function"].get("parameters")
        if params is not None:
            try:
                comp.json_schema(params)
            except GrammarError as e:
                param = f"tools[{i}].function.parameters"
                raise RequestError(f"'{param}' is not a JSON Schema this server can enforce: "
                                   f"{e}", param) from None
    grammar = None
    if req.json_schema is not None:
        try:
            grammar = comp.json_schema(req.json_schema)
        except GrammarError as e:
            raise RequestError(f"'response_format' holds a schema that cannot be compiled: {e}",
                               "response_format") from None
    forced = req.forced_tools
    if forced:
        try:
            grammar = comp.lark(tool_call_grammar(req.tools, forced, req.parallel_tool_calls))
        except GrammarError as e:
            raise RequestError(f"the tool calls of 'tool_choice' cannot be compiled: {e}",
                               "tools") from None
    if grammar is not None:
        req.decoding = dataclasses.replace(req.decoding or Decoding(),
                                           grammar=functools.partial(comp.matcher, grammar))


async def _next(job: Job, request: Request) -> tuple[str, Any]:
    """The next engine event for this job; notices a client that went away."""
    while True:
        try:
            item = await asyncio.wait_for(job.out.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled = True
                return "disconnected", None
            continue
        return item[0], item[1:]


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body; RequestError (413) once it is over `limit` bytes: at once when its
    Content-Length says so, else as soon as that many have come (never held whole)."""
    declared = request.headers.get("content-length", "")
    too_big = RequestError(f"the request body is over this server's limit of {limit} bytes "
                           "(max_body_mb)", None, status=413)
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request, limit: int) -> dict:
    """The request's JSON object; RequestError for a body over `limit` bytes (413), and (400)
    for one that is not JSON, not an object, nested past Python's recursion limit, or holds
    text that is not valid Unicode."""
    raw = await _read_body(request, limit)
    try:
        body = json.loads(raw)
        bad = bad_text_field(body)
    except RecursionError:
        raise RequestError("the body is nested too deeply", None) from None
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}", None) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    if bad is not None:
        raise RequestError(f"'{bad}' holds a string that is not valid Unicode (a lone UTF-16 "
                           "surrogate escape such as \\ud800); send UTF-8 text", bad)
    return body


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(f"the model {model!r} does not exist; this server serves {served!r}",
                           "model", status=404, code="model_not_found")


def _get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a bool", name)
    return v


def _tokenizer_of(engine: Engine):
    if engine.tokenizer is None:
        raise RequestError(f"the engine is {engine.status}: {engine.reason}" if engine.coord is
                           None else "the model has no tokenizer", None,
                           status=503 if engine.coord is None else 400)
    return engine.tokenizer


class Output:
    """One job's response: its choices' text and logprobs as the engine's events come, as a
    whole (`final`) or as server-sent events (`sse`)."""

    def __init__(self, job: Job, kind: str, model: str, render: Renderer) -> None:
        self.job, self.kind, self.model, self.render = job, kind, model, render
        self.rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        n = job.req.n
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.lps: list[list] = [[] for _ in range(n)]
        self.echo: list[list | None] = [None] * n  # prompt logprobs, once known
        self.done: list[dict | None] = [None] * n

    @property
    def finished(self) -> bool:
        return all(d is not None for d in self.done)

    @property
    def wants_logprobs(self) -> bool:
        d = self.job.req.decoding
        return d is not None and d.logprobs is not None

    def take(self, kind: str, index: int, payload: dict) -> None:
        if kind == "delta":
            self.text[index].append(payload["text"])
            self.lps[index].extend(payload["lp"])
            if "echo" in payload:
                self.echo[index] = payload["echo"]
        elif kind == "done":
            self.done[index] = payload
            if payload.get("echo") is not None:
                self.echo[index] = payload["echo"]

    # ---- pieces ------------------------------------------------------------------------------
    def _echo_text(self) -> str:
        req = self.job.req
        if req.prompt_text is not None:
            return req.prompt_text
        return self.render.tok.decode(self.job.prompt_ids, skip_special_tokens=False) if (
            self.render.tok is not None) else ""

    def _echo_entries(self, index: int) -> list:
        d = self.job.req.decoding
        if d is None or d.prompt_logprobs is None:
            return []
        ids = self.job.prompt_ids
        return [ids[0], *(self.echo[index] or [])] if ids else []

    def _logprobs(self, index: int, entries: list, echo: bool) -> dict | None:
        if self.kind == "chat":
            return self.render.chat_logprobs(entries) if self.wants_logprobs else None
        if not self.wants_logprobs:
            return None
        return self.render.completion_logprobs((self._echo_entries(index) if echo else [])
                                               + entries)

    def _usage(self) -> dict:
        done = [d for d in self.done if d is not None]
        return usage(done[0]["prompt_tokens"], sum(d["completion_tokens"] for d in done),
                     done[0]["cached_tokens"])

    def final(self) -> dict:
        choices = []
        for i in range(self.job.req.n):
            text, finish = "".join(self.text[i]), self.done[i]["finish_reason"]
            lp = self._logprobs(i, self.lps[i], echo=True)
            if self.kind == "chat":
                message = assistant_message(text, self.job.req.parses_tool_calls)
                if "tool_calls" in message and finish == "stop":
                    finish = "tool_calls"
                choices.append({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": lp})
            else:
                if self.job.req.echo:
                    text = self._echo_text() + text
                choices.append({"index": i, "text": text, "finish_reason": finish,
                                "logprobs": lp})
        return {"id": self.rid, "object": "chat.completion" if self.kind == "chat" else
                "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self._usage()}

    def _chunk(self, index: int, text: str | None, finish: str | None, lp: dict | None = None,
               role: bool = False, calls: list[dict] | None = None) -> bytes:
        if self.kind == "chat":
            d: dict = {}
            if role:
                d["role"] = "assistant"
            if text is not None:
                d["content"] = text
            if calls:
                d["tool_calls"] = calls
            choice = {"index": index, "delta": d, "finish_reason": finish, "logprobs": lp}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish,
                      "logprobs": lp}
            obj = "text_completion"
        return _sse_event({"id": self.rid, "object": obj, "created": self.created,
                           "model": self.model, "choices": [choice]})

    async def sse(self) -> AsyncIterator[bytes]:
        job, n = self.job, self.job.req.n
        echoed = [False] * n
        parsers = [ToolCallStream() for _ in range(n)] if job.req.parses_tool_calls else None
        called = [0] * n  # tool calls streamed, per choice
        try:
            if self.kind == "chat":
                for i in range(n):
                    yield self._chunk(i, "", None, role=True)
            while not self.finished:
                item = await job.out.get()
                if item[0] == "error":
                    status, err = item[1], item[2]
                    body = err.body() if isinstance(err, RequestError) else {"error": {
                        "message": str(err), "type": "service_unavailable" if status == 503
                        else "server_error", "param": None, "code": status}}
                    yield _sse_event(body)
                    break
                kind, i, payload = item
                self.take(kind, i, payload)
                if self.kind == "completion" and job.req.echo and not echoed[i] and (
                        kind == "done" or "echo" in payload):
                    echoed[i] = True
                    lp = (self.render.completion_logprobs(self._echo_entries(i))
                          if self.wants_logprobs else None)
                    yield self._chunk(i, self._echo_text(), None, lp)
                if parsers is not None:  # text and tool calls apart, as they complete
                    events = parsers[i].push(payload["text"]) if kind == "delta" else []
                    if kind == "done":
                        events = parsers[i].finish()
                    lp = (self._logprobs(i, payload["lp"], echo=False)
                          if kind == "delta" and payload["lp"] else None)
                    for what, value in events:
                        if what == "text":
                            yield self._chunk(i, value, None, lp)
                        else:
                            yield self._chunk(i, None, None, lp, calls=[
                                {"index": called[i], **value}])
                            called[i] += 1
                        lp = None
                    if lp is not None:
                        yield self._chunk(i, "", None, lp)
                    if kind == "done":
                        finish = payload["finish_reason"]
                        yield self._chunk(i, None, "tool_calls" if called[i] and
                                          finish == "stop" else finish)
                elif kind == "delta" and (payload["text"] or payload["lp"]):
                    lp = self._logprobs(i, payload["lp"], echo=False)
                    yield self._chunk(i, payload["text"], None, lp)
                elif kind == "done":
                    yield self._chunk(i, None if self.kind == "chat" else "",
                                      payload["finish_reason"])
            if self.finished and job.req.include_usage:
                yield _sse_event({"id": self.rid, "object": "chat.completion.chunk"
                                  if self.kind == "chat" else "text_completion",
                                  "created": self.created, "model": self.model,
                                  "choices": [], "usage": self._usage()})
            yield b"data: [DONE]\n\n"
        finally:
            job.cancelled = True  # a client that went away stops the generation at the next
            # token


def _sse_event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def serve(config: RuntimeConfig) -> int:
    import uvicorn

    app = create_app(config)
    engine: Engine = app.state.engine
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                        timeout_graceful_shutdown=int(config.grace_s), access_log=False)
    server = uvicorn.Server(uv)

    def announce() -> None:
        while engine.status == "loading" and not server.should_exit:
            time.sleep(0.1)
        if engine.status == "ready":
            host = config.host if ":" not in config.host else f"[{config.host}]"
            print(f"layersplit: serving {engine.served_model} on http://{host}:{config.port}/v1 "
                  f"({len(engine.coord.shards)} shards)", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 1 if engine.fatal else 0
