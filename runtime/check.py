"""`layersplit check`: our runtime's answers against an outside implementation, position by
position, on the user's own model and layout.

1. The reference (transformers in float32 on the same weights, or llama.cpp on the same GGUF)
   writes each prompt's greedy continuation and the logits of every step of it.
2. Teacher-forced: the runtime is fed the same tokens, one decode step at a time after the
   prompt's prefill, and its next-token logits are compared at every position
   (`runtime.parity.Agreement`: top-1 agreement, KL(reference ‖ ours), max |Δlogit|).
3. Free-running: the runtime generates greedily on its own (through the request path, in
   batches of `batch`); `greedy_equal` counts the prompts whose tokens equal the reference's,
   and the logits are compared up to the first token that differs.
4. Features on top, each compared with the plain run: speculation (where a draft serves: its
   tokens must equal plain decoding's where every step rounds alike, under `deterministic` or
   in float32 on CPUs; else they are counted, `equal_plain`), a prefix restored from RAM, and
   from disk after a restart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from layersplit.runtime.check_reference import ReferenceRun, run_reference
from layersplit.runtime.config import ConfigError, RuntimeConfig
from layersplit.runtime.errors import ShardFailure
from layersplit.runtime.generate import Progress
from layersplit.runtime.nonfinite_layer import first_nonfinite_layer
from layersplit.runtime.parity import Agreement, Thresholds, common_prefix
from layersplit.shards.chunking import prefill_chunks
from layersplit.shards.sampling_params import SamplingParams

log = logging.getLogger(__name__)

RESTORE_TIERS = ("ram", "disk")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckOptions:
    prompts: str | None = None  # a .jsonl file; None: the bundled prompts
    reference: str = "transformers"
    reference_device: str | None = None  # default: the first shard's device
    reference_model: str | None = None  # the reference's checkpoint; default: ours (the same
    # weights in another form, e.g. the HF folder a GGUF file was converted from)
    new_tokens: int = 64
    limit: int | None = None  # the first N prompts only
    batch: int = 1  # free-running requests decoded together
    restore: tuple[str, ...] = ()  # restore tiers to check ("ram", "disk")
    min_top1: float | None = None  # None: `Thresholds.for_dtype`
    max_kl: float | None = None

    def __post_init__(self) -> None:
        if self.new_tokens < 1:
            raise ConfigError(f"new_tokens={self.new_tokens}: give at least 1")
        if self.batch < 1:
            raise ConfigError(f"batch={self.batch}: give at least 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit}: give at least 1")
        for tier in self.restore:
            if tier not in RESTORE_TIERS:
                raise ConfigError(f"restore {tier!r}: use {' or '.join(RESTORE_TIERS)}")


def load_prompts(path: str | Path | None) -> list[dict[str, Any]]:
    """Prompts of a .jsonl file: each line an object with `messages` (a chat, rendered by the
    model's chat template), `prompt` (plain text) or `tokens` (token ids)."""
    if path is None:
        text = resources.files("layersplit.runtime").joinpath("check_prompts.jsonl").read_text()
        where = "the bundled prompts"
    else:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"prompts: cannot read {path} ({e})") from None
        where = str(path)
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}, line {n}: not JSON ({e})") from None
        keys = [k for k in ("messages", "prompt", "tokens") if isinstance(item, dict) and k in item]
        if len(keys) != 1:
            raise ConfigError(f"{where}, line {n}: expected an object with one of messages, "
                              "prompt or tokens")
        out.append(item)
    if not out:
        raise ConfigError(f"{where}: no prompts")
    return out


def encode_prompts(items: list[dict[str, Any]], tokenizer, vocab: int) -> list[list[int]]:
    """Token ids of each prompt. A model without a tokenizer (random weights) takes token ids
    only; for text prompts it gets seeded random ids instead, one prompt each."""
    out = []
    rng = random.Random(0)
    for i, item in enumerate(items):
        if "tokens" in item:
            ids = item["tokens"]
            if not (isinstance(ids, list) and ids and
                    all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
                raise ConfigError(f"prompt {i + 1}: tokens must be a non-empty list of ids "
                                  f"below the vocabulary size {vocab}")
            out.append(list(ids))
        elif tokenizer is None:
            out.append([rng.randrange(vocab) for _ in range(rng.randint(24, 96))])
        elif "messages" in item:
            out.append(tokenizer.encode_chat(item["messages"]))
        else:
            out.append(tokenizer.encode(str(item["prompt"])))
    return out


def teacher_forced(coord, run: ReferenceRun) -> np.ndarray:
    """Our logits for every token of the reference's continuation: the prompt's prefill, then
    the reference's tokens fed one decode step at a time (slot 0, driven by hand)."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    prompt, rows = run.prompt, []
    out = None
    for a, b in prefill_chunks(prompt, 0, len(prompt), coord.chunk, coord.eos_ids):
        out = coord.forward(prompt[a:b], a, greedy, 0, want_logits=b == len(prompt))
    rows.append(out.logits)
    pos = len(prompt)
    for tok in run.tokens[:-1]:
        out = coord.forward([tok], pos, greedy, 0, want_logits=True)
        rows.append(out.logits)
        pos += 1
    coord.batcher.sched.drop_held(0)
    return np.stack(rows).astype(np.float32)


@dataclasses.dataclass(slots=True)
class FreeRun:
    tokens: list[list[int]]
    logits: list[np.ndarray | None]
    cached: list[int]  # prompt tokens each request restored from the prefix cache
    tiers: list[str]  # and from which tier ("none", "ram", "disk")
    speculated: int  # requests that ran verify steps
    errors: list[str]  # why requests failed (their tokens are then empty)
    seconds: float
    failed: list[int] = dataclasses.field(default_factory=list)  # which prompts failed


def free_running(coord, prompts: list[list[int]], new_tokens: int, batch: int,
                 use_cache: bool, speculative: bool | None) -> FreeRun:
    """Greedy generation through the request path, `batch` prompts decoded together."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    record = speculative is False  # (logits are not recorded under speculation)
    run = FreeRun([], [], [], [], 0, [], 0.0)
    t0 = time.perf_counter()
    for a in range(0, len(prompts), batch):
        group = prompts[a:a + batch]
        progs = [Progress(logits=[] if record else None) for _ in group]
        reqs = [coord.submit(p, params, g, use_cache, speculative)
                for p, g in zip(group, progs)]
        while not all(r.done for r in reqs):
            coord.batcher.run_once()
        for r, p in zip(reqs, progs):
            if r.error is not None:  # (its logits went non-finite: the others went on)
                if getattr(r.error, "runtime_down", True):
                    raise r.error
                run.errors.append(str(r.error))
                run.failed.append(len(run.tokens))
                p = Progress()
            run.tokens.append(list(p.generated))
            run.logits.append(np.stack(p.logits).astype(np.float32) if record and p.logits
                              else None)
            run.cached.append(p.cached_tokens)
            run.tiers.append(p.cache_tier)
            run.speculated += p.spec is not None and p.spec.verifies > 0
    run.seconds = time.perf_counter() - t0
    return run


def compare_free(refs: list[ReferenceRun], run: FreeRun,
                 stop_ids: Sequence[int]) -> dict[str, Any]:
    """A free-running run against the reference: prompts equal, and logits up to (and at) the
    first token that differs (where both saw the same context). A request's tokens leave out
    the stop token that ended it (its logits row is there); the reference's keep it."""
    agree = Agreement()
    equal = 0
    for ref, toks, logits in zip(refs, run.tokens, run.logits):
        want = ref.tokens[:-1] if ref.tokens and ref.tokens[-1] in stop_ids else ref.tokens
        equal += toks == want
        if logits is not None:
            n = min(common_prefix(toks, want) + 1, len(logits), len(ref.tokens))
            agree.add(ref.logits[:n], logits[:n])
    return {"greedy_equal": equal, "prompts": len(refs), "seconds": round(run.seconds, 3),
            **({"agreement": agree.to_json()} if agree.positions else {})}


def run_check(cfg: RuntimeConfig, opts: CheckOptions,
              refs: list[ReferenceRun] | None = None) -> dict[str, Any]:
    """The whole check (see the module's doc); a JSON-able report with `pass`. `refs`: the
    reference's runs of these prompts, if already made (benchmarks check several layouts
    against one reference run)."""
    from layersplit.runtime.coordinator import Coordinator

    if opts.restore and not cfg.prefix_cache:
        raise ConfigError("restore needs the prefix cache (prefix_cache = true)")
    # a cache of its own, fresh: the cold runs are cold, and the user's cache is left alone
    restore_dir = tempfile.mkdtemp(prefix="layersplit-check-") if "disk" in opts.restore else None
    # (every step that can speculate does: the check is of speculation's output, not speed)
    cfg = cfg.replace(kv_cache_dir=restore_dir, max_seqs=max(cfg.max_seqs, opts.batch),
                      spec_max_seqs=max(cfg.spec_max_seqs, opts.batch) if cfg.spec_max_seqs
                      else 0, spec_policy="on")
    try:
        coord = Coordinator(cfg)
        items = load_prompts(opts.prompts)[:opts.limit]
        prompts = encode_prompts(items, coord.tokenizer, coord.model_config.vocab_size)
        longest = max(len(p) for p in prompts) + opts.new_tokens
        if longest > cfg.max_context:
            raise ConfigError(f"the longest prompt and its {opts.new_tokens} tokens need "
                              f"{longest} positions; max_context is {cfg.max_context}")
        ref_device = opts.reference_device or coord.placement.shards[0].device
        log.info("check: %d prompts, reference %s on %s, ours in %s on %s", len(prompts),
                 opts.reference, ref_device, coord.dtype, ",".join(cfg.devices))
        t0 = time.perf_counter()
        if refs is not None:
            if [r.prompt for r in refs] != prompts:
                raise ValueError("the reference runs given are not of these prompts")
        else:
            refs = run_reference(opts.reference, opts.reference_model or coord.model_path,
                                 prompts, opts.new_tokens, coord.eos_ids, ref_device,
                                 cfg.random_seed, progress=_progress("reference", len(prompts)))
        ref_s = time.perf_counter() - t0
        report = _check_ours(coord, cfg, opts, prompts, refs)
        report["reference_seconds"] = round(ref_s, 3)
        return report
    finally:
        if restore_dir is not None:
            shutil.rmtree(restore_dir, ignore_errors=True)


def reference_runs(cfg: RuntimeConfig, opts: CheckOptions, device: str
                   ) -> tuple[str, list[ReferenceRun], tuple[int, ...]]:
    """transformers float32's runs of `opts`' prompts on `cfg`'s model, made once for several
    `run_check` calls (benchmarks and tests check many layouts against one run): (the model's
    path, the runs, the stop ids)."""
    from layersplit.runtime.model_store import resolve_model
    from layersplit.runtime.tokenizer import TextTokenizer
    from layersplit.shards.checkpoint import open_checkpoint

    path = resolve_model(cfg.model)
    tok = TextTokenizer.for_model(path)
    mcfg = open_checkpoint(path).config
    stop = tuple(tok.eos_ids if tok is not None else ()) or tuple(mcfg.eos_token_ids)
    prompts = encode_prompts(load_prompts(opts.prompts)[:opts.limit], tok, mcfg.vocab_size)
    t0 = time.perf_counter()
    refs = run_reference("transformers", path, prompts, opts.new_tokens, stop, device)
    log.info("float32 reference of %s: %.1f s", path, time.perf_counter() - t0)
    return str(path), refs, stop


def _progress(what: str, total: int):
    step = max(1, total // 10)

    def note(done: int) -> None:
        if done % step == 0 or done == total:
            log.info("check: %s %d/%d prompts", what, done, total)
    return note


def _check_ours(coord, cfg: RuntimeConfig, opts: CheckOptions, prompts: list[list[int]],
                refs: list[ReferenceRun]) -> dict[str, Any]:
    from layersplit.runtime.coordinator import Coordinator

    # a half type's rounding, or llama.cpp's own arithmetic (quantized dot products), moves
    # logits more than float32 against float32 does
    base = "float16" if opts.reference == "llama.cpp" else coord.dtype
    thresholds = Thresholds.for_dtype(base)
    thresholds = Thresholds(opts.min_top1 if opts.min_top1 is not None else thresholds.min_top1,
                            opts.max_kl if opts.max_kl is not None else thresholds.max_kl)
    runs: dict[str, Any] = {}
    failures: list[str] = []
    # speculation keeps plain decoding's tokens exactly where every step is computed the same
    # way: deterministic mode (each verify row through the one-row decode step), or float32 on
    # CPUs (a batched verify step may round a near-tie otherwise); restores always do (the
    # cached rows are the very rows of the cold run)
    exact_spec = cfg.deterministic or (
        coord.dtype == "float32" and all(s.device == "cpu" for s in coord.placement.shards))
    diagnose: ReferenceRun | None = None  # the first prompt whose logits went non-finite
    try:
        coord.start()
        forced = Agreement()
        note = _progress("teacher-forced", len(refs))
        for i, ref in enumerate(refs):
            try:
                forced.add(ref.logits, teacher_forced(coord, ref))
            except ShardFailure as e:  # (logits that went non-finite: counted, then on)
                if e.runtime_down:
                    raise
                coord.batcher.sched.drop_held(0)
                forced.add_failed(len(ref.tokens))
                failures.append(f"teacher-forced, prompt {i + 1}: {e}")
                diagnose = diagnose or ref
            note(i + 1)
        failures += thresholds.failures(forced, "teacher-forced")
        plain = free_running(coord, prompts, opts.new_tokens, opts.batch, use_cache=False,
                             speculative=False)
        if diagnose is None and plain.errors:
            i = plain.failed[0]
            diagnose = ReferenceRun(prompts[i], refs[i].tokens, refs[i].logits)
        runs["plain"] = _free_report(refs, plain, coord.eos_ids, "free-running", failures)
        if coord.draft is not None:
            spec = free_running(coord, prompts, opts.new_tokens, opts.batch, use_cache=False,
                                speculative=None)
            same = sum(a == b for a, b in zip(spec.tokens, plain.tokens))
            runs["speculative"] = {**_free_report(refs, spec, coord.eos_ids, "speculative",
                                                  failures),
                                   "equal_plain": same, "speculated": spec.speculated}
            if spec.speculated == 0:
                failures.append("speculative: no request speculated (is the draft up?)")
            if exact_spec and same != len(prompts):
                failures.append(f"speculative: {len(prompts) - same} of {len(prompts)} "
                                "outputs differ from plain decoding's")
        if opts.restore:  # the prompts once more, cached this time (some share a prefix)
            free_running(coord, prompts, opts.new_tokens, opts.batch, use_cache=True,
                         speculative=False)
        if "ram" in opts.restore:
            runs["ram"] = _restored(coord, prompts, refs, opts, plain, "ram", failures)
        if "disk" in opts.restore:
            coord.close()  # a restart: only the disk tier is left
            coord = Coordinator(cfg)
            coord.start()
            runs["disk"] = _restored(coord, prompts, refs, opts, plain, "disk", failures)
    finally:
        coord.close()
    first_bad = None
    if diagnose is not None:  # (the runtime is down: its memory is free for the walk)
        log.info("check: finding the first layer whose output went non-finite")
        try:
            first_bad = first_nonfinite_layer(coord.model_path, coord.dtype,
                                              coord.placement.shards[0].device,
                                              diagnose.prompt + diagnose.tokens,
                                              cfg.random_seed)
        except Exception as e:  # noqa: BLE001 - the report stands; the walk says why it failed
            log.exception("check: the walk through the layers failed")
            first_bad = f"not found: the walk through the layers failed ({e})"
        failures.append(f"the first layer whose output went non-finite in {coord.dtype}: "
                        f"{first_bad or 'none, run layer by layer (the split path differs)'}")
    return {"model": str(cfg.model), "reference_model": opts.reference_model or str(cfg.model),
            "first_nonfinite_layer": first_bad,
            "dtype": coord.dtype, "devices": list(cfg.devices),
            "split": [s.layers for s in coord.placement.shards], "reference": opts.reference,
            "prompts": len(prompts), "new_tokens": opts.new_tokens,
            **forced.to_json(), "greedy_equal": runs["plain"]["greedy_equal"],
            "thresholds": dataclasses.asdict(thresholds), "runs": runs,
            "failures": failures, "pass": not failures}


def _free_report(refs: list[ReferenceRun], run: FreeRun, stop_ids: Sequence[int], what: str,
                 failures: list[str]) -> dict[str, Any]:
    out = compare_free(refs, run, stop_ids)
    if run.errors:
        out["errors"] = len(run.errors)
        failures.append(f"{what}: {len(run.errors)} requests failed ({run.errors[0]})")
    if out.get("agreement", {}).get("nonfinite_positions"):
        failures.append(f"{what}: non-finite logits")
    return out


def _restored(coord, prompts: list[list[int]], refs: list[ReferenceRun], opts: CheckOptions,
              plain: FreeRun, tier: str, failures: list[str]) -> dict[str, Any]:
    """The prompts again, each restored whole from the cache tier `tier`: the same tokens as
    the cold run (in any dtype: the cached rows are the cold run's own)."""
    run = free_running(coord, prompts, opts.new_tokens, opts.batch, use_cache=True,
                       speculative=False)
    same = sum(a == b for a, b in zip(run.tokens, plain.tokens))
    restored = sum(1 for c, t, p in zip(run.cached, run.tiers, prompts)
                   if c == len(p) and t == tier)
    out = {**_free_report(refs, run, coord.eos_ids, tier, failures), "equal_cold": same,
           "restored": restored, "cached_tokens": sum(run.cached)}
    if restored < len(prompts):
        failures.append(f"{tier}: {len(prompts) - restored} of {len(prompts)} prompts were not "
                        f"restored whole from the {tier} tier")
    if same != len(prompts):
        failures.append(f"{tier}: {len(prompts) - same} restored outputs differ from the cold "
                        "ones")
    return out


def summary(report: dict[str, Any]) -> str:
    """The report as a few lines for a terminal."""
    lines = [f"{report['model']} in {report['dtype']} on {','.join(report['devices'])} "
             f"(split {' '.join(report['split'])}) against {report['reference']}, "
             f"{report['prompts']} prompts:",
             f"  teacher-forced: top-1 {report['top1_agreement']:.4f} over "
             f"{report['positions']} positions, mean KL {_g(report['mean_kl'])}, max KL "
             f"{_g(report['max_kl'])}, max |dlogit| {_g(report['max_abs_logit_diff'])}",
             f"  free-running: {report['greedy_equal']}/{report['prompts']} prompts equal"]
    for name, run in report["runs"].items():
        if name == "plain":
            continue
        extra = ", ".join(f"{k} {v}" for k, v in run.items()
                          if k in ("equal_plain", "equal_cold", "restored"))
        lines.append(f"  {name}: {run['greedy_equal']}/{run['prompts']} equal the reference"
                     f"{', ' + extra if extra else ''}")
    lines.append("  PASS" if report["pass"] else "  FAIL: " + "; ".join(report["failures"]))
    return "\n".join(lines)


def _g(x: float | str) -> str:
    return x if isinstance(x, str) else f"{x:.3g}"


def check_main(cfg: RuntimeConfig, opts: CheckOptions, as_json: bool) -> int:
    report = run_check(cfg, opts)
    print(json.dumps(report) if as_json else summary(report))
    return 0 if report["pass"] else 1
