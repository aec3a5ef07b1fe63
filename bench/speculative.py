"""Speculative decoding next to plain decoding, same model, same split, same run.

For each draft (none, then each given): the real runtime (coordinator + shard processes + draft
process), generation on two prompt sets, one warm-up pass then a timed pass: `eval`, the held-out
prompts of `draft.prompts` (8 chat, 4 code: the draft's training reports on them, never trains on
them) and `unseen`, `bench/prompts/unseen.jsonl` (16 prompts no part of the draft's training
ever saw: code in other languages, chat, math, prose, tool calls; kept here, not in `draft/`).
Greedy by default; `--temperature 0.7 --top-p 0.9` samples (seeded), where `--sampling` runs each
draft with each `spec_sampling` given (coupled, rejection, guesses). Reports decode tok/s (generated
tokens over decode time, all prompts together), the speed-up over plain decoding in this run, the
acceptance length (mean tokens committed per verify step), the acceptance rate per draft position,
draft and verify time per step, and how many outputs equal the plain ones token for token.

    python bench/speculative.py --model default --devices cuda:0,cuda:1 \\
        --drafts default,/path/to/classic-draft --new-tokens 256

`--push on,off` runs each draft with the draft handing its prepared proposals to the first shard
(`spec_push`, the default) and with the coordinator asking for each. `--trees 0,15,31` runs each
draft with token trees of that many draft tokens (0: a chain, one row each). Prints a table last;
`--json FILE` also writes the rows. `--repeat N` runs the whole sequence (plain, then each draft) N
times over and adds each draft's median speed-up: a verify step's cost moves between runs on one
machine, and the ratio with it.

`--oracle-acceptance A` measures speculation at a given acceptance on shapes without a trained
draft (random weights, `--model random:qwen3-8b-chain --drafts random:qwen3-8b-dflash-b16`): the
plain greedy run's outputs become the table of the bench oracle (`draft.oracle`), whose draft
network really runs at its full size and whose proposals are those outputs with errors placed so
that the mean tokens per verify step is A. Reports, next to each ratio, its ideal A x t_plain /
t_verify (a round that cost only its verify step) and a round's time split into verify, draft
(waiting for the proposal; of it, computing) and the rest (host time, hops, moves). Before the
timed pass, untimed ones add their outputs to the table (until one adds none, at most
`--oracle-passes`, default 6), so that where a verify step's rounding (bf16; with `--streams` also
the other streams' rows in the step) left the plain output the timed pass's proposals follow the
runtime's own. A target of chain weights (`random:qwen3-8b-chain`, `random:qwen3.5-27b-chain`:
`shards.random_weights`) needs none of that: its greedy tokens are the same in every step whatever
its rows, so the table holds and the first untimed pass adds nothing; a Gaussian target's top
logits tie within rounding every few dozen tokens, and at 8 streams six passes left its acceptance
at 4.7 for an A of 6.3. A random model has no tokenizer: its prompts are `--limit` (default 12)
seeded random token ids of `--prompt-len` tokens (set `random`).

`--policies auto,on` runs each draft under each `spec_policy`: `on` (the default here) makes every
step speculate, so a row measures speculation itself; under `auto` the runtime's policy chooses
each step's tree size or plain decoding from what it measures (`docs/speculative.md`), and the
rows say how many verify and plain steps it ran; `declined` runs `measured` with a policy that
never speculates (every step plain, the draft loaded, its rows sent only near a probe that never
comes): what a plain step costs under the policy, against plain decoding without a draft in the
same run; `idle` loads the draft and lets no sequence feed it (`spec_max_seqs` 0): what the
draft process's presence alone costs. `--sets check` takes
the 56 chat prompts of `runtime/check_prompts.jsonl` (no draft's training saw them).

`--alternate auto,declined` measures a policy against another in one process per draft: the two
take turns, `--repeat` rounds, each round in the other order than the last (the measured policy
keeps what it learnt), and the report is each round's ratio and their median. Plain decoding's
speed differs between processes by up to 30 % on a small model (bench/RESULTS.md, S14), which
the other modes' ratios carry; this one's does not, though it compares with plain steps that
have the draft loaded (`declined`), not with a run without it.

`--streams N` decodes the prompts N at a time in one continuous batch (`spec_max_seqs` N: each
of them speculating with its own draft context, verified in batched steps), and reports the
aggregate tok/s: every generated token over each group's wall time, prefill included (the same
for plain and speculative runs). Use `--ignore-eos` so that no stream leaves its group early.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.draft.oracle_table import ORACLE_ENV  # noqa: E402
from layersplit.draft.prompts import EVAL_CHAT, EVAL_CODE  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.runtime.spec_policy import PolicyKnobs, SpecPolicy  # noqa: E402
from layersplit.runtime.speculative import SpecStats  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

log = logging.getLogger("bench.speculative")
ALTERNATING = ("auto", "measured", "declined")  # `--alternate`: policies one process can switch
UNSEEN = Path(__file__).resolve().parent / "prompts" / "unseen.jsonl"
CHECK = Path(__file__).resolve().parents[1] / "runtime" / "check_prompts.jsonl"


def prompt_sets(names: list[str]) -> dict[str, list[list[dict]]]:
    """Chat conversations (lists of messages) by set name."""
    out = {}
    for name in names:
        if name == "eval":
            out[name] = [[{"role": "user", "content": q}] for q in EVAL_CHAT + EVAL_CODE]
        elif name in ("unseen", "check"):
            out[name] = [json.loads(line)["messages"] for line in
                         (UNSEEN if name == "unseen" else CHECK).read_text().splitlines()
                         if line.strip()]
        else:
            raise SystemExit(f"--sets: unknown prompt set {name!r} (eval, unseen, check)")
    return out


def run(args, draft: str, plain_tokens: dict | None, tree: int | None = None,
        draft_device: str | None = None, push: bool = True,
        sampling: str = "coupled", deterministic: bool = False,
        micro_batches: int = 0, policy: str = "on",
        alternate: tuple[str, ...] = ()) -> list[dict]:
    """One row per prompt set. `policy` `declined` (the bench's own): `measured`, with a policy
    that never speculates (`declining`); `idle`: the draft loaded, no sequence feeding it.
    `alternate` (`--alternate`): these policies (`ALTERNATING`) take turns in this one
    process, `args.repeat` rounds, each round in the other order than the last: one row per
    round, policy and set (`round`, `policy`)."""
    if alternate:
        policy = "measured"
    declined, idle = policy == "declined", policy == "idle"
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")), draft=draft,
                        draft_device=draft_device, dtype=args.dtype,
                        max_context=args.max_context, transport=(args.transport,),
                        spec_block=args.block, spec_tree=tree, threads=args.threads,
                        prefix_cache=False, spec_push=push,
                        spec_sampling=sampling, deterministic=deterministic,
                        micro_batches=micro_batches,
                        spec_policy="measured" if declined or idle else policy,
                        **({"max_seqs": args.streams} if args.streams > 1 else {}),
                        **({"spec_max_seqs": 0 if idle else args.streams}
                           if args.streams > 1 or idle else {}))
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=args.ignore_eos,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed)
    name = ("none" if draft == "none" else Path(draft).name
            + ("" if tree is None else f" tree={tree}")
            + ("" if draft_device is None else f" on {draft_device}")
            + ("" if push else " push off")
            + ("" if params.greedy or draft == "none" else f" {sampling}")
            + (" deterministic" if deterministic else "")
            + (f" micro_batches={micro_batches}" if micro_batches else "")
            + ("" if policy == "on" else f" policy={policy}"))
    rows = []
    with Coordinator(cfg) as coord:
        if declined and coord.spec_policy is not None:
            coord.spec_policy = declining(coord.spec_policy)
        kind = coord.draft_info.get("kind", "-") if coord.draft else "-"
        transport = ",".join(s["transport_out"] for s in coord.shard_info()[:-1]) or "-"
        sets = prompt_ids(coord, args)
        warm = next(iter(sets.values()))
        for p in warm[:2]:  # warm-up: graph capture, compilation, caches
            collect(coord.stream(p, params, Progress()), Progress(), len(p))
        if args.streams > 1:  # ... and at the batch the streams run (its steps' own shapes:
            # a verify step of `streams` sequences is a graph, a compilation of its own)
            coord.generate_batch(warm[:args.streams], [params] * min(args.streams, len(warm)),
                                 use_cache=False, speculative=[True] * min(args.streams,
                                                                           len(warm)))
        oracle = os.environ.get(ORACLE_ENV) if draft != "none" else None
        turns = [(1, policy)] if not alternate else [
            (k + 1, pol) for k in range(args.repeat)
            for pol in (alternate if k % 2 == 0 else alternate[::-1])]
        measured = coord.spec_policy
        for k, pol in turns:
            fields = {"draft": name, "kind": kind, "transport": transport}
            if alternate:  # (the measured policy keeps what it learnt in its earlier turns)
                coord.spec_policy = declining(measured) if pol == "declined" else measured
                fields.update(draft=f"{Path(draft).name} policy={pol}", round=k, policy=pol)
            rows += _run_sets(coord, sets, params, plain_tokens, args, oracle, fields)
    return rows


def _run_sets(coord: Coordinator, sets: dict[str, list[list[int]]], params: SamplingParams,
              plain_tokens: dict | None, args, oracle: str | None, fields: dict) -> list[dict]:
    """One timed pass over each prompt set (after the oracle's untimed ones): a row each."""
    rows = []
    name = fields["draft"]

    def measure(prompts: list[list[int]], plain: dict | None) -> dict:
        return (_measure(coord, prompts, params, plain) if args.streams <= 1 else
                _measure_streams(coord, prompts, params, plain, args.streams))

    for set_name, prompts in sets.items():
        row = {**fields, "set": set_name}
        plain = None if plain_tokens is None else plain_tokens[set_name]
        for k in range(1, args.oracle_passes + 1 if oracle else 0):  # untimed
            extra = measure(prompts, plain)
            added = add_to_oracle(oracle, prompts, extra["outputs"])
            print(f"{name}, {set_name}: untimed oracle pass {k}: acceptance "
                  f"{extra['acceptance_length'] or 0:.2f}, {added} new outputs in the table",
                  flush=True)
            if not added:  # (the table is what the next pass follows: it decodes the same)
                break
        row.update(measure(prompts, plain))
        row["prompt_ids"] = prompts
        rows.append(row)
    return rows


def declining(policy: SpecPolicy) -> SpecPolicy:
    """A policy of `policy`'s sizes whose first look at a batch never ends: every step a plain
    step with the draft loaded, fed and its rows parked (`--policies declined`: what plain
    steps cost under the policy, against plain decoding without a draft in the same run)."""
    return SpecPolicy(policy.sizes, PolicyKnobs(refresh=1 << 40), policy.spec_seqs)


def prompt_ids(coord: Coordinator, args) -> dict[str, list[list[int]]]:
    """The prompt sets as token ids: chat prompts through the model's tokenizer, or for a model
    without one (random weights) `--limit` seeded random prompts of `--prompt-len` tokens."""
    if coord.tokenizer is not None:
        return {k: [coord.tokenizer.encode_chat(m) for m in v][:args.limit]
                for k, v in prompt_sets(args.sets.split(",")).items()}
    rng = random.Random(args.seed)
    vocab = coord.model_config.vocab_size
    return {"random": [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                       for _ in range(args.limit or 12)]}


def write_oracle(base: list[dict], acceptance: float, seed: int) -> str:
    """The bench oracle's table (`draft.oracle`) from the plain greedy rows: each prompt with
    its output; a private temporary file."""
    seqs = [r["prompt_ids"][i] + r["outputs"][i] for r in base for i in range(len(r["outputs"]))]
    fd, path = tempfile.mkstemp(prefix="oracle-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"acceptance": acceptance, "seed": seed, "sequences": seqs}, f)
    return path


def add_to_oracle(path: str, prompts: list[list[int]], outputs: dict) -> int:
    """A speculative pass's outputs join the oracle's table (read again by the draft at each
    sequence's start); how many were new to it. Where a verify step's rounding left the plain
    output (bf16 on GPUs), the next pass's proposals follow what this one produced instead of
    the draft's own. With several streams a batched verify step's rounding can also depend on
    the other streams' (the step's rows: a stream that left the table runs longer, so the
    steps after it are batched otherwise), so the next pass can still leave this one's outputs
    later on: passes go on until one adds nothing (`--oracle-passes` at most)."""
    raw = json.loads(Path(path).read_text())
    have = {tuple(x) for x in raw["sequences"]}
    new = [seq for i, out in outputs.items() if tuple(seq := prompts[i] + out) not in have]
    if not new:
        return 0
    raw["sequences"] += new
    tmp = Path(path).with_suffix(".new")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(raw))  # (private to the user, as the table it replaces)
    os.replace(tmp, path)
    return len(new)


def oracle_split(row: dict, plain_tok_s: float, streams: int) -> dict:
    """Per round (a verify step and the proposal before it), ms: the whole round; its verify
    step as the coordinator sees it (from sending the step to its result, hops and the shards'
    host time included, less the first shard's wait for the proposal: `SpecStats.verify_s`);
    the wait for the proposal (and of it, the draft computing); the rest (the coordinator's
    own time between rounds). The ideal ratio A x t_plain / t_verify: a round that cost only
    its verify step, A the measured acceptance, t_plain a plain step's time (at `streams`
    sequences: from their aggregate tok/s)."""
    a = row["acceptance_length"] or 1.0
    round_ms = 1000 * a / max(row["decode_tok_s"] / max(streams, 1), 1e-9)
    verify, draft = row["verify_ms"], row["draft_ms"]
    t_plain = 1000 * max(streams, 1) / max(plain_tok_s, 1e-9)
    return {"round_ms": round_ms, "rest_ms": round_ms - verify - draft,
            "ideal": a * t_plain / max(verify, 1e-9), "plain_step_ms": t_plain}


def _measure(coord: Coordinator, prompts: list[list[int]], params: SamplingParams,
             plain_tokens: dict | None) -> dict:
    """One prompt set, timed: decode speed, acceptance, outputs (and how many equal plain's)."""
    tokens, seconds, same = 0, 0.0, 0
    total = SpecStats()
    outs = {}
    for i, p in enumerate(prompts):
        progress = Progress()
        r = collect(coord.stream(p, params, progress), progress, len(p))
        n = len(r.tokens) - 1
        if n > 0:
            tokens += n
            seconds += n / max(r.decode_tok_s, 1e-9)
        outs[i] = r.tokens
        if plain_tokens is not None and plain_tokens.get(i) == r.tokens:
            same += 1
        if progress.spec is not None:
            total.merge(progress.spec)
    return {"decode_tok_s": tokens / max(seconds, 1e-9), "tokens": tokens, "prompts": len(prompts),
            "same_as_plain": same if plain_tokens is not None else None,
            "acceptance_length": total.acceptance_length,
            "acceptance_by_position": [round(x, 3) for x in total.acceptance_rates()],
            "draft_ms": 1000 * total.draft_s / max(total.verifies, 1),
            "draft_compute_ms": 1000 * total.draft_compute_s / max(total.verifies, 1),
            "verify_ms": 1000 * total.verify_s / max(total.verifies, 1),
            "prepared": total.prepared / max(total.verifies, 1),
            "verdict_lag_ms": 1000 * total.verdict_lag_s / max(total.prepared, 1),
            "request_lag_ms": 1000 * total.request_lag_s / max(total.prepared, 1),
            "ready_lead_ms": 1000 * total.ready_lead_s / max(total.prepared, 1),
            "off_chain": total.off_chain / max(total.verifies, 1),
            **_policy_fields(total), "outputs": outs}


def _policy_fields(total: SpecStats) -> dict:
    """What the speculation policy chose over a prompt set: verify steps, plain steps it ran,
    verify steps by draft tokens proposed."""
    return {"spec_rounds": total.verifies, "spec_off_steps": total.off_steps,
            "spec_untapped": total.untapped, "spec_restarts": total.restarts,
            "spec_sizes": {str(k): v for k, v in sorted(total.sizes.items())}}


def _measure_streams(coord: Coordinator, prompts: list[list[int]], params: SamplingParams,
                     plain_tokens: dict | None, streams: int) -> dict:
    """`_measure` with the prompts decoded `streams` at a time in one batch: aggregate tok/s."""
    tokens, seconds, same = 0, 0.0, 0
    phase_tokens, phase_s, prefill_s = 0, 0.0, 0.0
    gaps: list[list[float]] = []  # per stream
    total = SpecStats()
    outs = {}
    for lo in range(0, len(prompts), streams):
        group = prompts[lo:lo + streams]
        progs = [Progress() for _ in group]
        t0 = time.perf_counter()
        results = coord.generate_batch(group, [params] * len(group), use_cache=False,
                                       speculative=[True] * len(group), progress=progs)
        end = time.perf_counter()
        seconds += end - t0
        # the decode phase: from the moment every stream has its first token (its prompt
        # prefilled) to the end, and the tokens that came out in it
        times = [pr.token_times for pr in progs if pr.token_times]
        if times:
            started = max(t[0] for t in times)
            prefill_s += started - t0
            phase_s += end - started
            phase_tokens += sum(1 for t in times for x in t if x > started)
            gaps += [step_gaps([x for x in t if x > started]) for t in times]
        for i, (r, pr) in enumerate(zip(results, progs, strict=True), start=lo):
            tokens += len(r.tokens)
            outs[i] = r.tokens
            same += plain_tokens is not None and plain_tokens.get(i) == r.tokens
            if pr.spec is not None:
                total.merge(pr.spec)
    verifies = max(total.verifies, 1)
    return {"decode_tok_s": tokens / max(seconds, 1e-9), "tokens": tokens,
            "prompts": len(prompts), "same_as_plain": same if plain_tokens is not None else None,
            "acceptance_length": total.acceptance_length,
            "acceptance_by_position": [round(x, 3) for x in total.acceptance_rates()],
            "draft_ms": 1000 * total.draft_s / verifies,
            "draft_compute_ms": 1000 * total.draft_compute_s / verifies,
            "verify_ms": 1000 * total.verify_s / verifies, "outputs": outs,
            **_policy_fields(total),
            "prefill_phase_s": prefill_s, "decode_phase_tok_s": phase_tokens / max(phase_s, 1e-9),
            **stalls(gaps)}


def step_gaps(times: list[float], same: float = 50e-6) -> list[float]:
    """Seconds between a stream's steps: between the distinct moments its tokens came out
    (those within `same` of each other, a round's kept tokens: one step's)."""
    moments: list[float] = []
    for t in sorted(times):
        if not moments or t - moments[-1] > same:
            moments.append(t)
    return [b - a for a, b in zip(moments, moments[1:])]


def stalls(streams: list[list[float]], factor: float = 4.0) -> dict:
    """Where a decode phase's time went beyond its steady steps, from each stream's step gaps:
    the median step (ms); `stall_ms`, the time steps longer than `factor` x the median took
    beyond it, per stream (a graph captured, a kernel compiled on the decode path, a probe's
    rounds); the five longest steps (ms)."""
    gaps = [g for s in streams for g in s]
    if not gaps:
        return {"stall_ms": 0.0, "median_step_ms": 0.0, "longest_steps_ms": []}
    med = statistics.median(gaps)
    return {"median_step_ms": 1000 * med,
            "stall_ms": 1000 * sum(g - med for g in gaps if g > factor * med) / len(streams),
            "longest_steps_ms": [round(1000 * g, 2) for g in sorted(gaps)[-5:][::-1]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--devices", default="cuda:0,cuda:1")
    p.add_argument("--drafts", default="default", help="comma-separated drafts to compare")
    p.add_argument("--transport", default="auto")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--block", type=int, default=None, help="spec_block (rows per verify)")
    p.add_argument("--trees", default=None, help="comma-separated spec_tree values to run each "
                   "draft with (draft tokens of its token tree; 0: a chain); default: the "
                   "draft's own")
    p.add_argument("--draft-devices", default=None, help="comma-separated draft devices to "
                   "run each draft on (default: the first shard's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="the runtime's dtype (auto: bf16 on GPUs)")
    p.add_argument("--repeat", type=int, default=1, help="run plain and every draft this many "
                   "times, in turn")
    p.add_argument("--push", default="on", help="comma-separated spec_push settings to run "
                   "each draft with (on, off)")
    p.add_argument("--sets", default="eval,unseen", help="comma-separated prompt sets: eval "
                   "(draft.prompts' held-out ones), unseen (bench/prompts/unseen.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sampling", default="coupled", help="comma-separated spec_sampling "
                   "settings to run each draft with when sampling (coupled, rejection, guesses; "
                   "named: the runtime's `auto` is `coupled` where spec_policy measures, "
                   "else off for a DFlash draft on GPUs)")
    p.add_argument("--deterministic", action="store_true", help="run the drafts with "
                   "`deterministic = true`, and plain decoding in that mode too (its cost "
                   "against the default mode's plain decoding, the first row)")
    p.add_argument("--streams", type=int, default=1, help="decode the prompts this many at a "
                   "time in one batch, each speculating (spec_max_seqs): aggregate tok/s")
    p.add_argument("--spec-micro-batches", type=int, default=0, help="micro_batches of the "
                   "drafts' runs (plain decoding keeps the default, 0: auto, one group per "
                   "shard): with --streams, how the speculating streams share the chain")
    p.add_argument("--oracle-acceptance", type=float, default=None, help="the drafts' "
                   "proposals are the plain greedy run's outputs, wrong where a draw says so: "
                   "mean tokens per verify step A (the bench oracle; DFlash drafts, greedy)")
    p.add_argument("--oracle-passes", type=int, default=6, help="at most this many untimed "
                   "speculative passes before the timed one, each adding its outputs to the "
                   "oracle's table, until one adds none")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each random prompt "
                   "(a model without a tokenizer)")
    p.add_argument("--policies", default="on", help="comma-separated spec_policy settings to "
                   "run each draft with: on (every step speculates: speculation's own cost), "
                   "auto or measured (the policy chooses each step's size, or plain decoding), "
                   "declined (measured, never speculating: plain steps with the draft loaded), "
                   "idle (the draft loaded, no sequence feeding it: spec_max_seqs 0)")
    p.add_argument("--alternate", default=None, help="two of auto, measured, declined: in one "
                   "process per draft they take turns, --repeat rounds, each round in the "
                   "other order; the first's tok/s over the second's, round by round (no "
                   "difference between processes in the ratio)")
    p.add_argument("--json", default=None)
    p.add_argument("--log-policy", action="store_true", help="log each decision of the "
                   "speculation policy (its rates and measurements) on stderr")
    args = p.parse_args()
    if args.oracle_acceptance is not None and (args.temperature > 0 or args.trees not in
                                               (None, "0")):
        raise SystemExit("--oracle-acceptance: greedy chains only (no --temperature, "
                         "--trees 0)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.log_policy:
        logging.getLogger("layersplit.runtime.spec_policy").setLevel(logging.DEBUG)
    if args.alternate is not None:
        return main_alternate(args)
    rows = []
    for rep in range(1, args.repeat + 1):
        base = run(args, "none", None)
        plain = {r["set"]: r["outputs"] for r in base}
        trees = [None] if args.trees is None else [int(t) for t in args.trees.split(",")]
        places = [None] if args.draft_devices is None else args.draft_devices.split(",")
        pushes = [x == "on" for x in args.push.split(",")]
        modes = args.sampling.split(",") if args.temperature > 0 else ["coupled"]
        speed = {r["set"]: r["decode_tok_s"] for r in base}
        group = list(base)
        if args.oracle_acceptance is not None:  # (read by the draft processes started below)
            os.environ[ORACLE_ENV] = write_oracle(base, args.oracle_acceptance, args.seed)
        det = args.deterministic
        if det:  # plain decoding in deterministic mode, against the default mode's
            group += run(args, "none", plain, deterministic=True)
        for d in args.drafts.split(","):
            for t in trees:
                for place in places:
                    for push in pushes:
                        for s, pol in ((s, pol) for s in modes
                                       for pol in args.policies.split(",")):
                            group += run(args, d, plain, t, place, push, s, det,
                                         args.spec_micro_batches, pol)
                            for r in group[-len(base):]:  # as each finishes: a cut run keeps them
                                print(f"run {rep}, {r['set']}, {r['draft']}: "
                                      f"{r['decode_tok_s']:.1f} tok/s, "
                                      f"{r['decode_tok_s'] / speed[r['set']]:.2f} x plain "
                                      f"({speed[r['set']]:.1f})", flush=True)
        if args.oracle_acceptance is not None:
            Path(os.environ.pop(ORACLE_ENV)).unlink()
        for r in group:
            r["run"] = rep
            r["speedup"] = r["decode_tok_s"] / speed[r["set"]]
            if args.oracle_acceptance is not None and r["draft"] != "none":
                r["oracle"] = oracle_split(r, speed[r["set"]], args.streams)
        rows += group
        if args.json:  # (after each run: a run cut at a deadline keeps the ones before)
            Path(args.json).write_text(json.dumps(rows, indent=1))
    how = ("greedy" if args.temperature == 0 else
           f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}, "
           f"seed {args.seed}")
    print(f"\nmodel {args.model}, devices {args.devices}, prompt sets {args.sets}, {how}, up "
          f"to {args.new_tokens} new tokens")
    print("| run | set | draft | kind | decode tok/s | vs plain | acceptance length | "
          "per position | draft ms/step (computing) | verify ms/step | same as plain | "
          "verify / plain steps (sizes) |")
    print("|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        pos = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) or "-"
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']}/{r['prompts']}"
        steps = "-" if r["draft"] == "none" else (
            f"{r['spec_rounds']} / {r['spec_off_steps']} "
            f"({' '.join(f'{k}:{v}' for k, v in r['spec_sizes'].items())})")
        print(f"| {r['run']} | {r['set']} | {r['draft']} | {r['kind']} | {r['decode_tok_s']:.1f} | "
              f"{r['speedup']:.2f} | "
              f"{acc} | {pos} | {r['draft_ms']:.2f} ({r['draft_compute_ms']:.2f}) | "
              f"{r['verify_ms']:.2f} | {same} | {steps} |")
    if args.oracle_acceptance is not None:
        print(f"\nbench oracle, acceptance {args.oracle_acceptance}: each ratio next to its "
              "ideal (A x t_plain / t_verify); a round's ms")
        print("| run | set | draft | acceptance | vs plain | ideal | plain step | round | "
              "verify | draft (computing) | rest |\n|---|---|---|---:|---:|---:|---:|---:|"
              "---:|---:|---:|")
        for r in rows:
            o = r.get("oracle")
            if o is None:
                continue
            print(f"| {r['run']} | {r['set']} | {r['draft']} | {r['acceptance_length']:.2f} | "
                  f"{r['speedup']:.2f} | {o['ideal']:.2f} | {o['plain_step_ms']:.2f} | "
                  f"{o['round_ms']:.2f} | {r['verify_ms']:.2f} | {r['draft_ms']:.2f} "
                  f"({r['draft_compute_ms']:.2f}) | {o['rest_ms']:.2f} |")
    if args.streams > 1:  # (each run's plain row first: the same run's ratio)
        print("\n| run | set | draft | until every stream's first token, s | decode phase "
              "tok/s | vs plain's |\n|---|---|---|---:|---:|---:|")
        plain_phase = {(r["run"], r["set"]): r["decode_phase_tok_s"] for r in rows
                       if r["draft"] == "none"}
        for r in rows:
            base = plain_phase.get((r["run"], r["set"])) or 1e-9
            print(f"| {r['run']} | {r['set']} | {r['draft']} | {r['prefill_phase_s']:.2f} | "
                  f"{r['decode_phase_tok_s']:.1f} | {r['decode_phase_tok_s'] / base:.2f} |")
    if args.repeat > 1:
        for d, st in dict.fromkeys((r["draft"], r["set"]) for r in rows
                                   if r["draft"] != "none"):
            ratios = sorted(r["speedup"] for r in rows if r["draft"] == d and r["set"] == st)
            print(f"{d} ({st}): median {statistics.median(ratios):.2f} x plain over "
                  f"{len(ratios)} runs ({', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


def main_alternate(args) -> int:
    """`--alternate A,B`: plain decoding once (the outputs to compare with), then per draft one
    process in which A and B take turns (`run`'s `alternate`); prints each round's A / B and
    their median."""
    pols = tuple(args.alternate.split(","))
    if len(pols) != 2 or pols[0] == pols[1] or not set(pols) <= set(ALTERNATING):
        raise SystemExit(f"--alternate {args.alternate}: two different ones of "
                         f"{', '.join(ALTERNATING)}")
    if args.oracle_acceptance is not None:
        raise SystemExit("--alternate: not with --oracle-acceptance")
    base = run(args, "none", None)
    plain = {r["set"]: r["outputs"] for r in base}
    turns = {d: run(args, d, plain, alternate=pols) for d in args.drafts.split(",")}
    rows = base + [r for rs in turns.values() for r in rs]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    rate = "decode_phase_tok_s" if args.streams > 1 else "decode_tok_s"
    print(f"\nmodel {args.model}, devices {args.devices}, prompt sets {args.sets}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, "
          f"{pols[0]} and {pols[1]} taking turns in one process per draft")
    print("| round | set | draft | tok/s | verify / plain steps | same as plain |\n"
          "|---|---|---|---:|---|---:|")
    for r in rows:
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']}/{r['prompts']}"
        steps = "-" if r["draft"] == "none" else f"{r['spec_rounds']} / {r['spec_off_steps']}"
        print(f"| {r.get('round', '-')} | {r['set']} | {r['draft']} | {r[rate]:.1f} | {steps} "
              f"| {same} |")
    for d, rs in turns.items():
        for st in dict.fromkeys(r["set"] for r in base):
            by = {(r["round"], r["policy"]): r[rate] for r in rs if r["set"] == st}
            ratios = [by[(k, pols[0])] / by[(k, pols[1])] for k in range(1, args.repeat + 1)]
            print(f"{Path(d).name} ({st}): {pols[0]} / {pols[1]} in one process: median "
                  f"{statistics.median(ratios):.3f} over {len(ratios)} rounds "
                  f"({', '.join(f'{x:.3f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
