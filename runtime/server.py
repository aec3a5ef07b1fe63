"""`layersplit serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the runtime.

One engine thread owns the coordinator (its sockets are used from that thread only) and runs
every request in one continuous batch (`runtime.batching`): new requests join between steps,
finished ones leave at once; HTTP handlers talk to it through thread-safe queues. A client
that disconnects cancels its request at the next step. A shard failure fails the requests in
flight with 503, `/health` reports it, and the shard group is restarted (or the server exits,
with `restart_on_failure = false`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from layersplit.runtime.batching import Request as BatchRequest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.decoding import Decoding, ProcessorsTooLarge
from layersplit.runtime.generate import Progress
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
from layersplit.runtime.tool_calls import ToolCallStream, parse_tool_calls, tool_format
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("layersplit.server")


@dataclasses.dataclass
class Job:
    req: ParsedRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # once tokenized
    started: list[BatchRequest] = dataclasses.field(default_factory=list)  # its sequences

    def emit(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            self.cancelled = True


class Engine:
    """The coordinator, its request queue and its health, on a thread of its own."""

    def __init__(self, config: RuntimeConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.status, self.reason = "loading", "starting the shards"
        self.coord: Coordinator | None = None
        self.served_model = config.served_model_name or _model_name(config.model)
        self.tokenizer = None
        self.max_context = config.max_context
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        self._stop_at = float("inf")
        self.fatal: str | None = None
        self._followers: list[Active] = []  # first choices whose job's others wait for them
        self._grammars: Any = None  # runtime.grammar.GrammarCompiler, once a request needs it
        self._grammars_lock = threading.Lock()

    def grammars(self):
        """The grammar compiler of the served model's tokenizer (built on first use)."""
        from layersplit.runtime.grammar import GrammarCompiler

        coord = self.coord
        if coord is None or self.tokenizer is None:
            raise RequestError(f"the engine is {self.status}: {self.reason}" if coord is None
                               else "the model has no tokenizer: no structured output", None,
                               status=503 if coord is None else 400)
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, coord.model_config.vocab_size,
                                                 coord.eos_ids)
            return self._grammars

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float) -> None:
        """Let the running requests finish within the grace period (those still waiting for a
        KV slot get 503 at once, those still running at its end too), then stop the shards."""
        self._stop_at = time.monotonic() + grace_s
        self._stopping = True
        self.jobs.put(None)
        self._thread.join(grace_s + 150)

    def submit(self, job: Job) -> None:
        if self.status != "ready":
            raise RequestError(f"the engine is {self.status}: {self.reason}", None, status=503,
                               type_="service_unavailable")
        self.jobs.put(job)
        self.metrics.queue.set(self.jobs.qsize())

    # ---- engine thread ------------------------------------------------------------------------
    def _boot(self) -> None:
        self.status, self.reason = "loading", "starting the shards"
        self.metrics.up.set(0)
        coord = Coordinator(self.config)
        coord.start()
        coord.step_observer = lambda kind, dt: self.metrics.step_time.labels(kind).observe(dt)
        coord.batcher.step_observer = self.metrics.step_sequences.observe
        self.coord, self.tokenizer = coord, coord.tokenizer
        self.metrics.model.info({"model": self.served_model, "dtype": coord.dtype,
                                 "shards": str(len(coord.placement.shards))})
        self.status, self.reason = "ready", ""
        self.metrics.up.set(1)

    def _run(self) -> None:
        try:
            self._boot()
        except Exception as e:  # noqa: BLE001 - reported through /health and the exit path
            log.error("could not start the shards: %s", e)
            self.status, self.reason, self.fatal = "degraded", str(e), str(e)
            _exit_soon()
            return
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - a bug outside any one request: the server
            # cannot go on, so it says so and exits rather than leave every request hanging
            log.exception("the engine loop failed")
            self.status, self.reason, self.fatal = "degraded", str(e), str(e)
            self.metrics.up.set(0)
            for job in self._drain_jobs():
                job.emit(("error", 503, f"the engine failed: {type(e).__name__}: {e}"))
            _exit_soon()
        finally:
            if self.coord is not None:
                self.coord.close()
                self.coord = None

    def _drain_jobs(self) -> list[Job]:
        jobs = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _loop(self) -> None:
        active: list[Active] = []
        stopping = False
        while True:
            busy = any(not a.req.done or a.req.deltas for a in active) or (
                self.coord is not None and self.coord.batcher.busy)
            while not stopping:  # take every job that waits (block only when idle)
                try:
                    job = self.jobs.get(timeout=0.2) if not busy else self.jobs.get_nowait()
                except queue.Empty:
                    break
                self.metrics.queue.set(self.jobs.qsize())
                if job is None:
                    stopping = True
                    break
                if not job.cancelled:
                    started = self._start_contained(job)
                    if started:
                        active.extend(started)
                        busy = True
            coord = self.coord
            if stopping:
                active = self._shut_out(active)
            if stopping and not active:
                break
            if coord is None:
                continue
            if not active and not coord.batcher.busy:  # idle: a shard that dies now is
                coord.check_alive()  # restarted at once, not found by the next request
            if coord.batcher.busy:
                try:
                    coord.batcher.run_once()
                except Exception as e:  # noqa: BLE001 - a bug: the batch's requests fail, and
                    # the shard group restarts (its steps in flight are in an unknown state)
                    log.exception("the batch failed")
                    for a in active:
                        a.job.emit(("error", 500, f"internal error: {type(e).__name__}: {e}"))
                    active = []
                    self._recover(f"internal error: {type(e).__name__}: {e}")
                    continue
            active = [a for a in active if not self._pump_contained(a)]
            if self._followers:
                active.extend(self._start_followers())
            self.metrics.running.set(len(active))
            if coord.batcher is not None:
                self.metrics.observe_batch(coord.batcher)
            if coord.failed is not None:
                for a in active:
                    a.job.emit(("error", 503, f"the runtime is down: {coord.failed}"))
                active = []
                self._recover(coord.failed)

    def _recover(self, why: str) -> None:
        self._followers = []  # their jobs failed with the rest
        self.status, self.reason = "degraded", why
        self.metrics.up.set(0)
        if self.coord is not None:
            self.coord.close()
            self.coord = None
        if self._stopping:
            return
        if not self.config.restart_on_failure:
            log.error("a shard failed (%s); exiting (restart_on_failure is off)", why)
            self.fatal = why
            _exit_soon()
            return
        log.warning("a shard failed (%s); restarting the shard group", why)
        self.metrics.shard_restarts.inc()
        while not self._stopping:
            try:
                self._boot()
                return
            except Exception as e:  # noqa: BLE001 - keep trying, report via /health
                self.status, self.reason = "degraded", f"restart failed: {e}"
                log.error("restart of the shard group failed: %s; retrying in 5 s", e)
                time.sleep(5)

    def _shut_out(self, active: list[Active]) -> list[Active]:
        """Shutting down: requests still waiting for a KV slot, and every one past the grace
        period, get 503."""
        for lead in self._followers:  # choices not started will not be
            lead.job.emit(("error", 503, "the server is shutting down"))
        self._followers = []
        if self.coord is None:
            for a in active:
                a.job.emit(("error", 503, "the server is shutting down"))
            return []
        late = time.monotonic() > self._stop_at
        keep = []
        for a in active:
            waiting = not a.req.done and a.req.slot < 0
            if (late or waiting) and not a.req.done:
                self.coord.batcher.cancel(a.req)
                a.job.emit(("error", 503, "the server is shutting down"))
            else:
                keep.append(a)
        return keep

    def _start_contained(self, job: Job) -> list[Active]:
        """`_start`, where an exception fails this job alone (500) and never the engine thread:
        one bad request must not take the server down."""
        try:
            return self._start(job)
        except Exception as e:  # noqa: BLE001 - any bug here is this request's, not the server's
            log.exception("request could not start")
            job.emit(("error", 500, f"internal error: {type(e).__name__}: {e}"))
            if self.coord is not None:
                for r in job.started:
                    self.coord.batcher.cancel(r)
            return []

    def _pump_contained(self, a: Active) -> bool:
        """`_pump`, where an exception fails this request alone (and frees its KV slot)."""
        try:
            return self._pump(a)
        except Exception as e:  # noqa: BLE001 - as in _start_contained
            log.exception("request failed while its output was handed on")
            a.job.emit(("error", 500, f"internal error: {type(e).__name__}: {e}"))
            if self.coord is not None and not a.req.done:
                self.coord.batcher.cancel(a.req)
            return True

    def _start(self, job: Job) -> list[Active]:
        """Tokenize and check a job and queue its `n` sequences in the batch; [] if it failed
        at once."""
        coord, req = self.coord, job.req
        if coord is None:
            job.emit(("error", 503, f"the engine is {self.status}: {self.reason}"))
            return []
        try:
            if req.kind == "chat":
                ids = coord.tokenizer.encode_chat(req.messages, tools=req.tools)
            elif req.prompt_ids is not None:
                ids = req.prompt_ids
            else:
                ids = coord.tokenizer.encode(req.prompt_text)
            if len(ids) >= coord.config.max_context:
                field = "messages" if req.kind == "chat" else "prompt"
                raise RequestError(f"the prompt has {len(ids)} tokens; this server's context "
                                   f"is {coord.config.max_context} tokens", field)
            coord.check_prompt(ids)
        except (RequestError, ValueError) as e:
            err = e if isinstance(e, RequestError) else RequestError(str(e), "prompt")
            job.emit(("error", err.status, err))
            return []
        self.metrics.prompt_tokens.inc(len(ids))
        job.prompt_ids = list(ids)
        # n > 1: the first choice prefills the prompt and snapshots it in the prefix cache;
        # the others start once its first token is out, from that snapshot (no prefill)
        shared = (req.n > 1 and req.use_cache and coord.cache is not None and
                  (req.decoding is None or req.decoding.prompt_logprobs is None))
        started = []
        for i in range(1 if shared else req.n):
            a = self._submit_choice(job, i)
            if a is None:
                for b in started:
                    coord.batcher.cancel(b.req)
                return []
            started.append(a)
        if shared:
            self._followers.append(started[0])
        return started

    def _submit_choice(self, job: Job, index: int) -> Active | None:
        """Queue choice `index` of a tokenized job; None if it failed (the job is told)."""
        coord, req = self.coord, job.req
        params = req.params
        if index and params.seed is not None:  # the choices of a seeded request differ
            params = dataclasses.replace(params, seed=(params.seed + index) & ((1 << 63) - 1))
        progress = Progress()
        try:
            r = coord.submit(job.prompt_ids, params, progress, use_cache=req.use_cache,
                             speculative=req.speculative, decoding=req.decoding)
        except (ValueError, ShardFailure) as e:
            job.emit(("error", 400, RequestError(str(e), None)) if isinstance(e, ValueError)
                     else ("error", 503, str(e)))
            return None
        job.started.append(r)
        return Active(job, r, progress, len(job.prompt_ids), index)

    def _start_followers(self) -> list[Active]:
        """The other choices of the jobs whose first choice has its first token (its prompt's
        snapshot is in the prefix cache) or is over."""
        started, waiting = [], []
        for lead in self._followers:
            job = lead.job
            if job.cancelled:
                continue
            if lead.progress.first_token_at is None and not lead.req.done:
                waiting.append(lead)
                continue
            for i in range(1, job.req.n):
                a = self._submit_choice(job, i)
                if a is None:
                    break
                started.append(a)
        self._followers = waiting
        return started

    def _pump(self, a: Active) -> bool:
        """Hand the request's new text to its client; True once it is over."""
        req = a.req
        while req.deltas and not a.job.cancelled:
            d = req.deltas.popleft()
            now = time.perf_counter()
            if a.last is None:
                self.metrics.ttft.observe(now - a.job.arrived)
            else:
                self.metrics.itl.observe(now - a.last)
            a.last = now
            event = {"text": d.text, "lp": [d.lp] if d.lp is not None else []}
            if not a.sent and a.job.req.echo:
                event["echo"] = a.progress.prompt_logprobs
            a.sent = True
            a.job.emit(("delta", a.index, event))
        if a.job.cancelled:
            self.coord.batcher.cancel(req)  # its slot is free at once
        if not req.done:
            return False
        if req.error is not None and not a.job.cancelled:
            e = req.error
            if isinstance(e, ShardFailure):
                a.job.emit(("error", 503, str(e)))
            elif isinstance(e, ProcessorsTooLarge):  # the request's own limit, named
                a.job.emit(("error", 400, RequestError(str(e), None)))
            else:
                log.error("request failed: %s: %s", type(e).__name__, e)
                a.job.emit(("error", 500, f"internal error: {type(e).__name__}: {e}"))
            return True
        self._finish(a)
        return True

    def _finish(self, a: Active) -> None:
        coord, progress, req = self.coord, a.progress, a.job.req
        n = len(progress.generated)
        self.metrics.generated_tokens.inc(n)
        if progress.decode_tok_s:
            self.metrics.decode_tok_s.set(progress.decode_tok_s)
        if progress.cache_tier != "none":
            self.metrics.cache_hits.labels(progress.cache_tier).inc()
            self.metrics.cached_tokens.inc(progress.cached_tokens)
        elif req.use_cache and coord.cache is not None:
            self.metrics.cache_misses.inc()
        if coord.cache is not None:
            self.metrics.cache_bytes_written.set(coord.cache.stats.bytes_written)
        if progress.spec is not None:
            self.metrics.observe_speculation(progress.spec)
        a.job.emit(("done", a.index, {
            "finish_reason": "cancelled" if a.job.cancelled else progress.finish_reason,
            "prompt_tokens": a.prompt_tokens, "completion_tokens": n,
            "cached_tokens": progress.cached_tokens,
            "echo": progress.prompt_logprobs if not a.sent and a.job.req.echo else None,
        }))


@dataclasses.dataclass
class Active:
    """A job in the batch."""

    job: Job
    req: BatchRequest
    progress: Progress
    prompt_tokens: int
    index: int = 0  # its choice of the job (n > 1)
    last: float | None = None  # when its last token went out
    sent: bool = False  # a delta of it went out


def _model_name(model: str) -> str:
    if model in ("default", ""):
        return "SmolLM2-135M-Instruct"
    return os.path.basename(str(model).rstrip("/")) or str(model)


def _exit_soon() -> None:
    """Stop the server process (uvicorn shuts down on SIGTERM)."""
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()


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
        try:
            body = await _json_body(request, body_limit)
            req = parse(body, kind, engine.served_model, limits())
            loop = asyncio.get_running_loop()
            # (compiling a grammar may take a while: not on the event loop, which streams)
            await loop.run_in_executor(None, _constrain, engine, req)
            job = Job(req, loop, asyncio.Queue())
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
                ids = await loop.run_in_executor(
                    None, functools.partial(tok.encode_chat, req.messages, tools=req.tools))
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
    from layersplit.runtime.grammar import GrammarError, tool_call_grammar

    if engine.status != "ready":
        return  # (refused with 503 when it is submitted)
    if req.tools:
        tok = engine.tokenizer
        if tok is None or tool_format(tok.chat_template) is None:
            raise RequestError(f"the chat template of {engine.served_model} has no tool-call "
                               "format this server parses (supported: Hermes-style "
                               "<tool_call> JSON blocks, as Qwen2.5/Qwen3 and Hermes templates "
                               "write them)", "tools")
    if not req.tools and req.json_schema is None:
        return
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
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.job.req.parses_tool_calls:
                    message["content"], calls = parse_tool_calls(text)
                    if calls:
                        message["tool_calls"] = calls
                        finish = "tool_calls" if finish == "stop" else finish
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
