"""Request lifecycle: a prompt is checked, queued in the batch (`runtime.batching`) and run
as a sequence's program: its cached prefix restored, the rest prefilled, then decoded,
speculatively when the draft serves.

`RequestFlow` is one part of `runtime.coordinator.Coordinator`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from layersplit.ipc.messages import message
from layersplit.ipc.shm import HEADER_CAP
from layersplit.runtime.batching import Request
from layersplit.runtime.cache_ops import Restored
from layersplit.runtime.decoding import Decoding, StepFields
from layersplit.runtime.errors import DraftError, DraftLost
from layersplit.runtime.generate import (
    Delta,
    GenerationResult,
    OutputStream,
    Program,
    Progress,
    collect,
    sequence_program,
)
from layersplit.runtime.speculative import DraftClient, SpecStats
from layersplit.shards.chunking import cut_points
from layersplit.shards.sampling_params import SamplingParams, new_seed

log = logging.getLogger("layersplit.runtime.coordinator")  # (one name for the coordinator's parts)


class RequestFlow:
    """`submit` and the ways to read a request's output (`deltas`, `stream`, `generate`,
    `generate_batch`); `_program` is what one request does in its KV slot."""

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; max_context is "
                             f"{self.config.max_context}")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary")

    def submit(self, prompt: Sequence[int], params: SamplingParams, progress: Progress,
               use_cache: bool = True, speculative: bool | None = None,
               decoding: Decoding | None = None, keep_at: int | None = None) -> Request:
        """Queue one prompt in the batch (`batcher.run_once` then runs it); its tokens appear
        in the request's `tokens` as they are generated. `decoding`: logprobs and logits
        processors (`runtime.decoding`); the logprobs land in `progress`. `keep_at`: a chunk
        boundary of the prompt where it snapshots too (the end of a finished turn it continues,
        `turn_to_keep`, that no keep has cached: the entry the keep would have made)."""
        self._ensure_up()
        self.check_prompt(prompt)
        if self.tokenizer is None and params.stop:
            raise ValueError(f"{self.model_path} has no tokenizer, so stop strings cannot apply")
        if self.config.spec_required and self.draft_path is not None and self.draft is None:
            # the runtime is down without its draft: a server restarts the group, draft included
            raise self.fail(f"speculation is required (spec_required) but the draft is gone: "
                             f"{self.draft_down}")
        prompt = list(prompt)
        if decoding is not None and decoding.prompt_logprobs is not None:
            use_cache = False  # every prompt row is computed: a restored one has no logprobs
        if decoding is not None and decoding.processes:
            if speculative is not False and self.draft is not None:
                log.info("a request is not speculated: its %s change the logits (each row of "
                         "a verify step would need processors of its own)",
                         ", ".join(decoding.processors))
            speculative = False
        holder: list[Request] = []
        seed = params.seed if params.seed is not None else new_seed()  # (kept on preemption)

        def make(slot: int) -> Program:
            """The sequence's program from its prompt and what it generated so far (a
            preempted sequence runs again from both: `runtime.batching`)."""
            done = list(progress.generated)
            dec = decoding
            if done and dec is not None and dec.prompt_logprobs is not None:
                dec = dataclasses.replace(dec, prompt_logprobs=None)  # (sent already)
            elif not done:  # (preempted before its first token: its prompt runs again whole)
                progress.prompt_logprobs.clear()
                if progress.logits is not None:
                    progress.logits.clear()
            return self._program(holder[0], prompt + done, params, progress, use_cache,
                                 speculative, slot, dec, seed, holder[0].shared, keep_at)

        # a request that takes nothing from the cache takes no live prefix either (every row
        # of a prompt-logprobs request, or of one asked to run alone, is computed)
        cached = (None if not use_cache else
                  self.cache.cached_rows if self.cache is not None else lambda _: 0)
        # a prompt that starts with a turn being kept waits for it, then restores it
        self._kept = [(t, r) for t, r in self._kept if not r.done]
        after = next((r for t, r in self._kept
                      if use_cache and len(t) <= len(prompt) and prompt[:len(t)] == t), None)
        req = self.batcher.submit(len(prompt), make,
                                  OutputStream(self.tokenizer, params, self.eos_ids, progress),
                                  prompt, cut_points(prompt, self.chunk, self.eos_ids), cached,
                                  after)
        holder.append(req)
        return req

    def keep_turn(self, tokens: Sequence[int]) -> Request | None:
        """Keep a finished turn in the prefix cache: `tokens` are the conversation as the next
        turn's prompt starts (the prompt, the answer and the template's end of turn), cut at
        their last chunk boundary. Their rows past the longest cached prefix are prefilled as a
        cold run of any longer prompt computes them (the answer's decode steps computed its
        rows one at a time, which a prefill does not reproduce bit for bit) and snapshotted,
        with the draft's feature rows, in the RAM and disk tiers. A request whose prompt starts
        with them waits for this one and restores them. None where nothing is kept: no cache,
        or fewer than `keep_answers` new tokens (docs/prefix-cache.md, answers)."""
        tokens = self.turn_to_keep(tokens)
        if tokens is None:
            return None
        req = self.submit(tokens, SamplingParams(max_tokens=1), Progress(), use_cache=True,
                          speculative=False)
        self._kept.append((tokens, req))
        return req

    def turn_to_keep(self, tokens: Sequence[int]) -> list[int] | None:
        """What `keep_turn` would keep of a finished turn's `tokens`: them cut at their last
        chunk boundary; None where it keeps nothing."""
        if self.cache is None or self.config.keep_answers <= 0 or self.batcher is None or \
                self.failed is not None:
            return None
        tokens = list(tokens)
        end = max(cut_points(tokens, self.chunk, self.eos_ids), default=0)
        del tokens[end:]
        if not tokens or end >= self.config.max_context or \
                end - self.cache.cached_rows(tokens) < self.config.keep_answers:
            return None
        return tokens

    def deltas(self, req: Request) -> Iterator[Delta]:
        """The request's text deltas as the batch produces them (running the batch meanwhile);
        closing the iterator cancels the request."""
        try:
            while True:
                while not req.deltas and not req.done:
                    self.batcher.run_once()
                if req.deltas:
                    yield req.deltas.popleft()
                elif req.error is not None:
                    raise req.error
                else:
                    return
        finally:
            if self.batcher is not None:
                self.batcher.cancel(req)

    def stream(self, prompt: Sequence[int], params: SamplingParams, progress: Progress,
               use_cache: bool = True, speculative: bool | None = None) -> Iterator[Delta]:
        """Generate for one prompt; text deltas are yielded (see `_program`)."""
        return self.deltas(self.submit(prompt, params, progress, use_cache, speculative))

    def _program(self, req: Request, prompt: list[int], params: SamplingParams,
                 progress: Progress, use_cache: bool, speculative: bool | None,
                 slot: int, decoding: Decoding | None = None,
                 seed: int | None = None, shared: int = 0,
                 keep_at: int | None = None) -> Program:
        """One request in KV slot `slot`: restore its longest cached prefix, prefill the rest in
        chunks (snapshotting at its cache points), then decode, speculatively when the draft
        serves (unless `speculative` is False) and fewer than `spec_max_seqs` sequences feed
        it already; a feeding sequence sends the draft its rows, in its slot."""
        # (a sequence preempted and prefilled again keeps its first run's marks: its
        # `first_token_at` is that run's too)
        progress.marks.setdefault("admitted", time.perf_counter())
        if seed is None:
            seed = params.seed if params.seed is not None else new_seed()
        # up to spec_max_seqs sequences at a time feed the draft their rows and speculate (each
        # with its own draft context, in its slot; one asked not to speculate still feeds it,
        # so its cache entries carry feature rows, and so does a sampled one under spec_sampling
        # `off`: a prefix it caches first restores into a greedy request that speculates at
        # once); the others decode plainly in the same steps
        context = (self._free_contexts.pop(0) if self.draft is not None and
                   self._free_contexts else None)
        prog = None
        snaps: list[tuple[int, np.ndarray | None, int | None]] = []  # (end, logits, the step
        # that sent the draft its rows up to end): snapshots to take
        later, first_out, cache = False, False, None

        def cache_after_first(snapshot) -> None:
            """The prompt's snapshots, then (once its first token is out) the RAM copies of
            the entries restored from disk (`CacheManager.take_deferred`), off the first
            token's path; `progress.marks["cached"]` says when they are done (or dropped).
            None are taken once the slot no longer holds this sequence's rows (swapped out,
            `Request.rows_gone`): a miss later, never another sequence's rows under this
            prompt's key."""
            if req.rows_gone:
                snaps.clear()  # (the finally drops the deferred RAM copies too)
                progress.marks["cached"] = time.perf_counter()  # (nothing more will be)
                return
            t0, n = time.perf_counter(), len(snaps)
            snaps.sort(key=lambda s: s[0])  # (each entry is its predecessor's child)
            while snaps:
                snapshot(*snaps.pop(0))
            if cache is not None and first_out:
                cache.take_deferred(slot)
            progress.marks["cached"] = time.perf_counter()
            if n:
                log.debug("%d snapshots after the first token in %.1f ms", n,
                          (progress.marks["cached"] - t0) * 1e3)

        try:
            drafter = None
            mode = self.spec_sampling_mode()
            if context is not None and speculative is not False and \
                    (params.greedy or mode != "off"):
                progress.spec = SpecStats()
                sample = (None if params.greedy or mode == "guesses" else
                          {**params.wire(), "seed": seed, "mode": mode})
                drafter = DraftClient(self, progress.spec, self.config.spec_required, context,
                                      sample)
                drafter.begin()
            elif context is not None:  # it only feeds: its context starts afresh all the same
                try:
                    self.new_context(context)
                    self.draft_request(message("draft_begin", slot=context, sample=None))
                except (DraftLost, DraftError) as e:
                    log.warning("the draft did not start a context for this request: %s", e)
            cache = self.cache if use_cache else None
            restored = Restored()
            points: list[int] = []
            if shared:  # rows [0, shared) are another live sequence's blocks (`runtime.batching`)
                restored = Restored(length=shared, features=False)
            if cache is not None:
                cuts = cut_points(prompt, self.chunk, self.eos_ids)
                if not shared:
                    restored = cache.restore(prompt, cuts, slot,
                                             context if self.feeding else None)
                    progress.cached_tokens, progress.cache_tier = restored.length, restored.tier
                    progress.cache_resident = restored.resident and restored.length > 0
                # snapshot at the last cut inside the prompt (restorable into any longer prompt)
                # and at its very end (an exact repeat then needs no forward pass)
                last_cut = max([c for c in cuts if c <= len(prompt)], default=0)
                points = sorted({p for p in (last_cut, len(prompt), keep_at)
                                 if p is not None and p > restored.length})
            # the draft's context is whole if every row it needs came from this sequence's steps
            # or from the cache with its feature rows
            req.feed = context if self.feeding else None
            live = req.feed is not None and (restored.length == 0 or restored.features)
            if drafter is not None and (not drafter.active or (self.feeding and not live)):
                if drafter.active:
                    log.info("no speculation for this request: the restored prefix carries no "
                             "draft feature rows")
                drafter = None
            # a sequence that only feeds sends the draft the rows of its prompt alone: they are
            # read only by its snapshots, all inside the prompt (a kept answer is prefilled
            # again, `keep_turn`), so its decode steps are plain ones, sent ahead as such
            req.speculates = drafter is not None
            req.plain_next = drafter.plain_next if drafter is not None else _always
            req.may_park = drafter.may_park if drafter is not None else _always
            req.taps = drafter.taps if drafter is not None else _prompt_rows_only
            if req.feed is not None and not live:
                # its rows could not make the draft's context whole, nor its snapshots carry
                # them: the context goes back at once, for a request that can speculate
                self._give_back_context(context)
                context = req.feed = None
            parent = [restored.leaf]
            # the snapshots wait until the first token is out (they copy rows the next steps
            # do not change), and so the chunk ending at a cache point inside the prompt is not
            # waited for: its logits are kept as it comes back, while the next chunks run; a
            # hybrid model's state changes with the next step: at once, after waiting for it
            later = cache is not None and not cache.hybrid

            def snapshot(end: int, logits: np.ndarray | None, sync: int | None = None) -> None:
                e = cache.snapshot(prompt, end, logits, parent[0], slot,
                                   req.feed if live else None, sync)
                if e is not None:
                    parent[0] = e

            def on_boundary(end: int, logits: np.ndarray | None, sid: int | None = None
                            ) -> None:
                if end in points:
                    if later:  # (its draft rows are those of the prefill step that ends at
                        # `end`, never parked: `sid`, that step's id, where its output came
                        # back while later steps ran (not theirs: a later step that fails
                        # would leave the snapshot waiting for rows that never come); else
                        # the step just back, the last that fed the context)
                        snaps.append((end, logits, None if req.feed is None
                                      else sid if sid is not None
                                      else self.feat_sid(req.feed)))
                    else:
                        snapshot(end, logits)

            prog = sequence_program(prompt, params, seed, chunk=self.chunk,
                                    turn_end_ids=self.eos_ids, start=restored.length,
                                    start_logits=restored.logits,
                                    context=self.config.max_context,
                                    on_prefill_boundary=on_boundary if points else None,
                                    logits_at=points, boundaries_wait=not later,
                                    drafter=drafter,
                                    on_logits=None if progress.logits is None
                                    else progress.logits.append,
                                    **self._decoding_hooks(decoding, prompt, params, progress))
            t_prefill = time.perf_counter()
            progress.marks.setdefault("restored", t_prefill)
            item = next(prog)
            while not isinstance(item, int):
                item = prog.send((yield item))
            if cache is not None and restored.length < len(prompt):  # the prefill is done
                cache.note_prefill(len(prompt), len(prompt) - restored.length,
                                   time.perf_counter() - t_prefill)
            first_out = True
            if not later:
                cache_after_first(snapshot)
            got = yield item  # (the batch resumes it at once: the client has no token yet)
            while True:
                if later and got is not None:  # a step's output: the first token went out
                    later = False
                    cache_after_first(snapshot)
                item = prog.send(got)
                got = yield item
        except StopIteration:
            return
        finally:
            if later and self.failed is None:  # (it ended before a step came back: now,
                # while its slot still holds the rows)
                try:
                    cache_after_first(snapshot)
                except Exception as e:  # noqa: BLE001 - a cache entry is not worth the request
                    log.warning("prefix-cache snapshots at the end of a request failed: %s", e)
            if prog is not None:
                prog.close()
            if self.cache is not None:  # a RAM copy its slot did not take (cancelled or
                # preempted before its first token) must not be taken by the slot's next sequence
                self.cache.drop_deferred(slot)
            if context is not None:
                self._give_back_context(context)

    def _decoding_hooks(self, d: Decoding | None, prompt: list[int], params: SamplingParams,
                        progress: Progress) -> dict[str, Any]:
        """`sequence_program`'s step_fields, on_output and prompt_lp for a request's `d`."""
        if d is None:
            return {}
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        # every sequence of a step, and the step's own fields, share one ring slot's header
        budget = (HEADER_CAP - 4096) // (self.config.max_seqs + 1)
        fields = StepFields(d, prompt, stops, self.model_config.vocab_size, budget)
        return {"step_fields": fields, "on_output": progress.note_output,
                "prompt_lp": None if d.prompt_logprobs is None else {
                    "k": d.prompt_logprobs, "temperature": params.temperature}}

    def generate(self, prompt: Sequence[int], params: SamplingParams, use_cache: bool = True,
                 speculative: bool | None = None) -> GenerationResult:
        progress = Progress()
        return collect(self.stream(prompt, params, progress, use_cache, speculative), progress,
                       len(prompt))

    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       params: Sequence[SamplingParams], use_cache: bool = True,
                       speculative: Sequence[bool | None] | None = None,
                       progress: Sequence[Progress] | None = None) -> list[GenerationResult]:
        """Generate for several prompts at once (one continuous batch); results in order
        (`progress`, when given, one per prompt, gets each one's timings)."""
        spec = list(speculative) if speculative is not None else [None] * len(prompts)
        progs = list(progress) if progress is not None else [Progress() for _ in prompts]
        for p in prompts:  # every prompt is checked before any is queued
            self.check_prompt(p)
        reqs: list[Request] = []
        try:
            for p, sp, pr, s in zip(prompts, params, progs, spec, strict=True):
                reqs.append(self.submit(p, sp, pr, use_cache, s))
        except BaseException:
            for r in reqs:
                self.batcher.cancel(r)
            raise
        streams = [self.deltas(r) for r in reqs]
        live = list(range(len(streams)))
        try:
            while live:  # each pull runs the batch until that stream has a token
                for i in list(live):
                    if next(streams[i], None) is None:
                        live.remove(i)
        finally:
            for st in streams:
                st.close()
            for r in reqs:  # (a stream never started does not cancel its request on close)
                self.batcher.cancel(r)
        return [collect(iter(()), pr, len(p)) for p, pr in zip(prompts, progs, strict=True)]


def _always() -> bool:
    return True


def _prompt_rows_only(pos: int, may_skip: bool) -> bool:
    """`Request.taps` of a sequence that feeds the draft but does not speculate."""
    return not may_skip
