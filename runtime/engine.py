"""The server's engine thread: it owns the coordinator (whose sockets are used from this thread
only) and runs every request in one continuous batch (`runtime.batching`): new requests join
between steps, finished ones leave at once. HTTP handlers (`runtime.server`) hand it `Job`s
through a thread-safe queue and read each job's events from its asyncio queue. A shard failure
fails the requests in flight, and the shard group is restarted (or the server exits, with
`restart_on_failure = false`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from typing import Any

import jinja2
from layersplit.runtime import warmup
from layersplit.runtime.batching import Request as BatchRequest
from layersplit.runtime.config import RuntimeConfig
from layersplit.runtime.coordinator import Coordinator, ShardFailure
from layersplit.runtime.decoding import ProcessorsTooLarge
from layersplit.runtime.generate import Progress
from layersplit.runtime.metrics import Metrics
from layersplit.runtime.openai_api import ParsedRequest, RequestError
from layersplit.runtime.turns import next_turn_tokens

log = logging.getLogger("layersplit.server")
SAVE_POLL_S = 0.02  # an idle engine's wait for work while cache files are being written


@dataclasses.dataclass
class Job:
    req: ParsedRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # once tokenized
    marks: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> when it ended
    # (perf_counter): `parsed` (the HTTP side's checks), `taken` (by the engine thread),
    # `tokenized`, `queued` (in the batch); logged at the first token (`phases`)
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
        # finished turns to keep in the prefix cache, each once its time comes (perf_counter)
        # unless a request continues it first (`_keep_turn`, `_take_over_keep`)
        self._to_keep: list[tuple[float, list[int]]] = []
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
        try:  # ("ready" means the first request runs at the speed of the next ones)
            self.reason = "warming up"
            if self.config.cuda_graphs and self.config.capture_at_start:
                coord.warm_prefill_graphs()  # (every bucket: `shards.prefill_graphs`)
            warmup.run(coord)
        except BaseException:
            coord.close()
            raise
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
            while not stopping:  # take every job that waits (block only when idle, and only
                # until the next turn to keep is due)
                wait_s = 0.2 if not self._to_keep or self.coord is None else \
                    min(0.2, max(0.0, min(w for w, _ in self._to_keep) - time.perf_counter()))
                if not busy and self.coord is not None and self.coord.cache is not None and \
                        self.coord.cache.saves.pending():  # (busy: no wait, nothing to ask)
                    wait_s = min(wait_s, SAVE_POLL_S)  # (idle: the saves still go on)
                try:
                    job = self.jobs.get(timeout=wait_s) if not busy else self.jobs.get_nowait()
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
            if self._to_keep and coord is not None:  # (a server that stops keeps them all,
                self._start_keeps(everything=stopping)  # those its dropped requests took too)
            if stopping and not active and (coord is None or not coord.batcher.busy or
                                            time.monotonic() > self._stop_at):
                break  # (answers being kept in the prefix cache end first, within the grace)
            if coord is None:
                continue
            if not active and not coord.batcher.busy:  # idle: a shard that dies now is
                coord.check_alive()  # restarted at once, not found by the next request
                coord.poll_saves()  # (and a snapshot's file is finished, not left for it)
            if coord.batcher.busy:
                try:
                    coord.batcher.run_once()
                except Exception as e:  # noqa: BLE001 - a bug: the batch's requests fail, and
                    # the shard group restarts (its steps in flight are in an unknown state)
                    log.exception("the batch failed")
                    for a in active:
                        a.job.emit(("error", 500, f"internal error: {type(e).__name__}: {e}"))
                        self._requeue_keep(a)
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
                    self._requeue_keep(a)
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
                self._requeue_keep(a)
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
            self._requeue_keep(a)
            return True

    def _start(self, job: Job) -> list[Active]:
        """Tokenize and check a job and queue its `n` sequences in the batch; [] if it failed
        at once."""
        coord, req = self.coord, job.req
        job.marks["taken"] = time.perf_counter()
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
            job.marks["tokenized"] = time.perf_counter()
            if len(ids) >= coord.config.max_context:
                field = "messages" if req.kind == "chat" else "prompt"
                raise RequestError(f"the prompt has {len(ids)} tokens; this server's context "
                                   f"is {coord.config.max_context} tokens", field)
            coord.check_prompt(ids)
        except jinja2.exceptions.TemplateError as e:  # (e.g. roles it does not take)
            job.emit(("error", 400, RequestError(f"the chat template refused the messages: "
                                                 f"{e}", "messages")))
            return []
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
        keep_at = self._take_over_keep(job.prompt_ids) if req.use_cache and (
            req.decoding is None or req.decoding.prompt_logprobs is None) else None
        started = []
        for i in range(1 if shared else req.n):
            a = self._submit_choice(job, i, keep_at if i == 0 else None)
            if a is None:
                if keep_at is not None:  # (the keep it took over runs after all)
                    self._queue_keep(job.prompt_ids[:keep_at])
                for b in started:
                    coord.batcher.cancel(b.req)
                return []
            started.append(a)
        if shared:
            self._followers.append(started[0])
        job.marks["queued"] = time.perf_counter()
        return started

    def _submit_choice(self, job: Job, index: int, keep_at: int | None = None
                       ) -> Active | None:
        """Queue choice `index` of a tokenized job; None if it failed (the job is told)."""
        coord, req = self.coord, job.req
        params = req.params
        if index and params.seed is not None:  # the choices of a seeded request differ
            params = dataclasses.replace(params, seed=(params.seed + index) & ((1 << 63) - 1))
        progress = Progress()
        try:
            r = coord.submit(job.prompt_ids, params, progress, use_cache=req.use_cache,
                             speculative=req.speculative, decoding=req.decoding,
                             keep_at=keep_at)
        except (ValueError, ShardFailure) as e:
            job.emit(("error", 400, RequestError(str(e), None)) if isinstance(e, ValueError)
                     else ("error", 503, str(e)))
            return None
        job.started.append(r)
        kept = job.prompt_ids[:keep_at] if keep_at is not None else None
        return Active(job, r, progress, len(job.prompt_ids), index, keep=kept)

    def _start_followers(self) -> list[Active]:
        """The other choices of the jobs whose first choice has its first token (its prompt's
        snapshot is in the prefix cache) or is over."""
        started, waiting = [], []
        for lead in self._followers:
            job = lead.job
            if job.cancelled:
                continue
            if "cached" not in lead.progress.marks and not lead.req.done:
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
                self._observe_phases(a, now)
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
        self._requeue_keep(a)
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

    def _observe_phases(self, a: Active, now: float) -> None:
        """The request's time to its first token, phase by phase, in the metrics (and the
        debug log)."""
        got = phases(a.job, a.progress, now)
        for name, seconds in got.items():
            self.metrics.ttft_phase.labels(name).observe(seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("first token after %.1f ms: %s (%d prompt tokens, %d cached)",
                      (now - a.job.arrived) * 1e3,
                      ", ".join(f"{k} {v * 1e3:.1f}" for k, v in got.items()),
                      a.prompt_tokens, a.progress.cached_tokens)

    def _finish(self, a: Active) -> None:
        coord, progress, req = self.coord, a.progress, a.job.req
        n = len(progress.generated)
        self.metrics.generated_tokens.inc(n)
        if progress.decode_tok_s:
            self.metrics.decode_tok_s.set(progress.decode_tok_s)
        if progress.cache_tier != "none":
            self.metrics.cache_hits.labels(progress.cache_tier).inc()
            self.metrics.cached_tokens.inc(progress.cached_tokens)
            if progress.cache_resident:
                self.metrics.cache_resident_hits.inc()
        elif req.use_cache and coord.cache is not None:
            self.metrics.cache_misses.inc()
        if coord.cache is not None:
            self.metrics.cache_bytes_written.set(coord.cache.stats.bytes_written)
        if progress.spec is not None:
            self.metrics.observe_speculation(progress.spec)
            self.metrics.observe_policy(coord.spec_policy)
        if not a.job.cancelled and req.use_cache and req.n == 1 and coord.cache is not None:
            self._keep_turn(a)  # (queued before the client can send the next turn)
        a.job.emit(("done", a.index, {
            "finish_reason": "cancelled" if a.job.cancelled else progress.finish_reason,
            "prompt_tokens": a.prompt_tokens, "completion_tokens": n,
            "cached_tokens": progress.cached_tokens,
            "echo": progress.prompt_logprobs if not a.sent and a.job.req.echo else None,
        }))

    def _keep_turn(self, a: Active) -> None:
        """Keep the finished conversation in the prefix cache as its next turn will start
        (`runtime.turns`, `RequestFlow.keep_turn`), `keep_answers_delay_ms` from now: a request
        that continues it sooner keeps it itself (`_take_over_keep`), so it never waits behind
        the keep's restore and prefill; a template that cannot render it keeps nothing."""
        try:
            tokens = next_turn_tokens(self.tokenizer, a.job.req, a.job.prompt_ids,
                                      a.progress.generated, a.progress.text)
        except jinja2.exceptions.TemplateError as e:
            log.info("the answer is not kept: the chat template cannot render it (%s)", e)
            return
        except Exception as e:  # noqa: BLE001 - keeping is an optimisation: the answer the
            # client waits for must not turn into a 500 because a template or filter failed
            log.warning("the answer is not kept: %s: %s", type(e).__name__, e)
            return
        delay_s = self.config.keep_answers_delay_ms / 1e3
        if delay_s > 0:
            kept = self.coord.turn_to_keep(tokens)
            if kept is not None:
                self._queue_keep(kept, delay_s)
            return
        self._keep_now(tokens)

    def _keep_now(self, tokens: list[int]) -> None:
        try:
            self.coord.keep_turn(tokens)
        except ValueError as e:  # (tokens the prompt checks refuse: nothing to keep)
            log.info("the answer is not kept: %s", e)

    def _start_keeps(self, everything: bool) -> None:
        """Keep the finished turns whose time has come (all of them: `everything`)."""
        now = time.perf_counter()
        due = [t for when, t in self._to_keep if everything or when <= now]
        self._to_keep = [(when, t) for when, t in self._to_keep if not everything and when > now]
        for tokens in due:
            try:
                self._keep_now(tokens)
            except Exception as e:  # noqa: BLE001 - a keep is an optimisation: it must not
                # take the engine thread down (a shard's failure shows in `coord.failed`, which
                # the loop recovers from)
                log.warning("the answer is not kept: %s: %s", type(e).__name__, e)

    def _take_over_keep(self, prompt: list[int]) -> int | None:
        """The end of a finished turn not kept yet that `prompt` continues, or None: the
        prompt's request snapshots there (`RequestFlow.submit`'s `keep_at`), prefilling the
        turn's answer with its own new tokens, and the keep is dropped. (The rows are the
        keep's: its end is a chunk boundary of both, and chunk boundaries follow the tokens.)"""
        ends, pending = [], []
        for when, t in self._to_keep:  # (every pending keep the prompt continues is dropped:
            # the longest one's entry holds theirs)
            if len(t) <= len(prompt) and prompt[:len(t)] == t:
                ends.append(len(t))
            else:
                pending.append((when, t))
        self._to_keep = pending
        return max(ends, default=None)

    def _queue_keep(self, tokens: list[int], delay_s: float = 0.0) -> None:
        """Keep the finished turn `tokens` `delay_s` from now (`_start_keeps`), unless a
        request continues it first (`_take_over_keep`)."""
        self._to_keep.append((time.perf_counter() + delay_s, tokens))

    def _requeue_keep(self, a: Active) -> None:
        """The keep request `a` took over, due at once, where `a` ended or was dropped:
        `turn_to_keep` keeps nothing where `a`'s snapshot made the entry (its rows cached), and
        the keep where it did not (cancelled or failed before its prefill passed the turn, or
        its snapshot skipped)."""
        if a.keep is not None:
            self._queue_keep(a.keep)
            a.keep = None


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
    keep: list[int] | None = None  # the finished turn whose keep it took over (`keep_at`)


def phases(job: Job, progress: Progress, first_out: float) -> dict[str, float]:
    """Where a request's time to its first token went, in seconds, phase by phase (`PHASES`;
    those it did not pass through are left out; none is negative: a mark set out of order,
    a clock's step, counts as no time)."""
    marks = {**job.marks, **progress.marks}
    if progress.first_token_at is not None:
        marks["sampled"] = progress.first_token_at
    marks["out"] = first_out
    out, last = {}, job.arrived
    for name, mark in PHASES:
        if mark in marks:
            out[name] = max(0.0, marks[mark] - last)
            last = max(last, marks[mark])
    return out


PHASES = (  # (phase, the mark that ends it): a request's time to its first token
    ("parse", "parsed"),  # its body read and checked, its grammar compiled (the HTTP side)
    ("wait", "taken"),  # for the engine thread (busy with a step: a turn being kept, say)
    ("tokenize", "tokenized"),  # the chat template and the tokenizer
    ("queue", "queued"),  # into the batch
    ("slot", "admitted"),  # for a KV slot, and for a turn being kept that it starts with
    ("restore", "restored"),  # its cached prefix into its slot (RAM or disk tier)
    ("prefill", "sampled"),  # the steps of the rest of its prompt, to its first token sampled
    ("emit", "out"),  # the token's text handed to the HTTP side
)


def _model_name(model: str) -> str:
    if model in ("default", ""):
        return "SmolLM2-135M-Instruct"
    return os.path.basename(str(model).rstrip("/")) or str(model)


def _exit_soon() -> None:
    """Stop the server process (uvicorn shuts down on SIGTERM)."""
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
