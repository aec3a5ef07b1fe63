"""Where a step's time goes between processes: the per-step timestamps of every process of a
run (`LAYERSPLIT_STEP_TRACE=DIR`, `ipc/step_trace.py`) merged by step id.

    LAYERSPLIT_STEP_TRACE=/tmp/trace python3 bench/speculative.py ... --streams 8
    python3 bench/step_timeline.py /tmp/trace [--json out.json]

For each kind of step the coordinator sent (decode, verify, prefill), the median and 90th
percentile, in ms, of each stage along the chain: the coordinator's send to the first shard's
receipt, each shard's hold (waiting for the draft's proposals, a lookahead token, or the steps
before it), its host time to queue the step's kernels, its send on, the hop to the next shard,
the last shard's sampling, and the result's trip back; then the draft's verdict and proposal
times, after the last shard's sampling, and the proposal's trip to the first shard. Stages are
measured on one host's clock (`time.monotonic`), so the processes must share a host. A stage
missing from a step (a held step has no hold on a shard that did not hold it) is left out of
that step's numbers. Then, for one sequence's speculating rounds (a run that decodes one
sequence at a time: verify steps of one sequence, one after the other), their critical path:
from the proposal the draft prepared to the first shard's start, through both shards, to the
next proposal (`rounds`).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROLE = re.compile(r"^(coordinator|draft|shard-(\d+)-(\d+))-\d+-\d+\.jsonl$")
Run = tuple[dict[str, dict[int, dict[str, float]]], dict[int, str], list[str], dict[int, dict]]


def _read(path: Path) -> list[tuple[float, str, int, dict]]:
    return [tuple(json.loads(line)) for line in path.read_text().splitlines() if line]


def load(folder: Path) -> list[Run]:
    """One entry per coordinator (its sids start again at 1): (role -> sid -> event -> first
    time, sid -> the coordinator's kind of step, the shards' roles in chain order, sid -> the
    details of the coordinator's send: rows, seqs). A shard's or
    the draft's file belongs to the coordinator whose events span its first event's time (else
    the last one started before it): the processes a coordinator starts live inside its run."""
    coords, others = [], []
    for path in sorted(folder.iterdir()):
        m = ROLE.match(path.name)
        if m is None:
            continue
        lines = _read(path)
        if not lines:
            continue
        if m.group(1) == "coordinator":
            coords.append(lines)
        else:
            role = "draft" if m.group(1) == "draft" else f"shard-{m.group(2)}-{m.group(3)}"
            others.append((role, None if m.group(2) is None else int(m.group(2)), lines))
    coords.sort(key=lambda lines: lines[0][0])
    runs = []
    for lines in coords:
        events: dict[str, dict[int, dict[str, float]]] = collections.defaultdict(
            lambda: collections.defaultdict(dict))
        kinds, sent = {}, {}
        for t, event, sid, details in lines:
            if sid is not None:
                events["coordinator"][sid].setdefault(event, t)
                if event == "send":
                    kinds[sid] = details.get("kind", "?")
                    sent[sid] = details
        runs.append((events, kinds, {}, sent))
    for role, start, lines in others:
        t0 = lines[0][0]
        inside = [i for i, c in enumerate(coords) if c[0][0] <= t0 <= c[-1][0]]
        before = [i for i, c in enumerate(coords) if c[0][0] <= t0]
        if not inside and not before:
            continue
        events, _, shards, _ = runs[(inside or before)[-1]]
        if start is not None:
            shards[role] = start
        for t, event, sid, _ in lines:
            if sid is not None:
                events[role][sid].setdefault(event, t)
    return [(events, kinds, sorted(shards, key=shards.get), sent)
            for events, kinds, shards, sent in runs]


def stages(events: dict, shards: list[str], sid: int) -> dict[str, float]:
    """The stage durations (seconds) of step `sid`, in chain order."""
    out: dict[str, float] = {}
    prev = ("coordinator", "send")
    for i, role in enumerate(shards):
        name = f"shard {i}"
        chain = [(prev, (role, "recv"), "to " + name if i == 0 else f"hop to {name}"),
                 ((role, "recv"), (role, "run"), f"{name} held"),
                 ((role, "run"), (role, "queued"), f"{name} queues its kernels")]
        if i == len(shards) - 1:
            chain += [((role, "queued"), (role, "sampled"), f"{name} samples"),
                      ((role, "sampled"), (role, "sent"), f"{name} sends the result"),
                      ((role, "sent"), ("coordinator", "result"), "result to the coordinator")]
        else:
            chain.append(((role, "queued"), (role, "sent"), f"{name} sends on"))
        for (ra, ea), (rb, eb), label in chain:
            a, b = events[ra].get(sid, {}).get(ea), events[rb].get(sid, {}).get(eb)
            if a is not None and b is not None:
                out[label] = b - a
        prev = (role, "sent")
    last = shards[-1] if shards else None
    d = events["draft"].get(sid, {})
    sampled = events[last].get(sid, {}).get("sampled") if last else None
    if sampled is not None and "verdict" in d:
        out["verdict reaches the draft"] = d["verdict"] - sampled
        if "prepared" in d:
            out["draft prepares the proposal"] = d["prepared"] - d["verdict"]
            drafted = events[shards[0]].get(sid, {}).get("drafted")
            if drafted is not None:  # (handed over: `spec_push`)
                out["the proposal reaches the first shard"] = drafted - d["prepared"]
    c = events["coordinator"].get(sid, {})
    if "send" in c and "result" in c:
        out["total"] = c["result"] - c["send"]
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    """{median_ms, p90_ms, steps} of durations in seconds."""
    xs = sorted(xs)
    return {"median_ms": 1000 * statistics.median(xs),
            "p90_ms": 1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], "steps": len(xs)}


def _table(head: str, count: str, by: dict[str, dict[str, float]]) -> None:
    """Print stages' `_stats` as a markdown table under `head`."""
    print(f"\n{head}\n| stage | median ms | p90 ms | {count} |\n|---|---:|---:|---:|")
    for label, v in by.items():
        print(f"| {label} | {v['median_ms']:.3f} | {v['p90_ms']:.3f} | {v['steps']} |")


def summary(folder: Path) -> dict[str, dict[str, dict[str, float]]]:
    """kind -> stage -> {median_ms, p90_ms, steps}, over every run in the folder."""
    per: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for events, kinds, shards, _ in load(folder):
        for sid, kind in kinds.items():
            for label, dt in stages(events, shards, sid).items():
                per[kind][label].append(dt)
    return {kind: {label: _stats(xs) for label, xs in by.items()} for kind, by in per.items()}


def flow(folder: Path) -> dict[str, dict[str, float]]:
    """How full the chain was: per kind of step, its count and the mean sequences and rows of
    one; over every run, the time the coordinator had n steps in flight (send to result), as a
    share of the runs' time from their first send to their last result ("in flight n"), and
    the steps sent per second of that time. Speculating streams that share a chain should keep
    several steps in flight, each of several sequences."""
    per: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    spans: dict[int, float] = collections.Counter()
    total = 0.0
    steps = 0
    for events, kinds, _, sent in load(folder):
        edges = []
        for sid, kind in kinds.items():
            d = sent.get(sid, {})
            per[kind]["seqs"].append(float(d.get("seqs", 0)))
            per[kind]["rows"].append(float(d.get("rows", 0)))
            c = events["coordinator"].get(sid, {})
            if "send" in c and "result" in c:
                edges += [(c["send"], 1), (c["result"], -1)]
        if not edges:
            continue
        edges.sort()
        level, t_prev = 0, edges[0][0]
        for t, step in edges:
            spans[level] += t - t_prev
            level, t_prev = level + step, t
        total += edges[-1][0] - edges[0][0]
        steps += len(edges) // 2
    out: dict[str, dict[str, float]] = {}
    for kind, by in per.items():
        out[kind] = {"steps": len(by["seqs"]), "mean seqs": statistics.fmean(by["seqs"]),
                     "mean rows": statistics.fmean(by["rows"])}
    if total > 0:
        out["chain"] = {f"in flight {n}": spans[n] / total for n in sorted(spans)}
        out["chain"]["steps per s"] = steps / total
    return out


ROUND_STAGES = [  # (label, (role, event, step: 0 this one, -1 the one before), (role, event, step))
    ("proposal ready -> first shard starts the step", None, ("first", "run", 0)),
    ("first shard queues its kernels", ("first", "run", 0), ("first", "queued", 0)),
    ("first shard's send to the last shard's receipt", ("first", "sent", 0),
     ("last", "recv", 0)),
    ("last shard holds the step", ("last", "recv", 0), ("last", "run", 0)),
    ("last shard queues its kernels", ("last", "run", 0), ("last", "queued", 0)),
    ("last shard waits for the device and samples", ("last", "queued", 0),
     ("last", "sampled", 0)),
    ("verdict reaches the draft", ("last", "sampled", 0), ("draft", "verdict", 0)),
    ("the draft's proposal", ("draft", "verdict", 0), ("draft", "prepared", 0)),
    ("round", ("draft", "prepared", -1), ("draft", "prepared", 0)),
]


def rounds(folder: Path) -> dict[str, Any]:
    """The critical path of one sequence's speculating rounds (verify steps of one sequence
    that follow one another, in a run that decodes one sequence at a time, the draft handing
    its proposals to the first shard): per stage
    the median and 90th percentile in ms, from the proposal the step before prepared to the
    one this step's verdict prepared; the first stage starts when both the proposal and the
    coordinator's step are at hand, and `coordinator late` counts the rounds whose step came
    after the proposal (the coordinator on the path). Empty without such rounds."""
    per: dict[str, list[float]] = collections.defaultdict(list)
    late = n = 0
    for events, kinds, shards, sent in load(folder):
        if len(shards) < 2:
            continue
        roles = {"first": shards[0], "last": shards[-1], "draft": "draft"}
        for sid, kind in kinds.items():
            if kind != "verify" or kinds.get(sid - 1) != "verify" or \
                    sent[sid].get("seqs") != 1 or sent[sid - 1].get("seqs") != 1:
                continue
            def at(where: tuple[str, str, int] | None, sid: int = sid) -> float | None:
                if where is None:
                    return None
                role, event, step = where
                return events[roles[role]].get(sid + step, {}).get(event)  # noqa: B023

            ready, recv = at(("draft", "prepared", -1)), at(("first", "recv", 0))
            times = [(at(a), at(b)) for _, a, b in ROUND_STAGES]
            if ready is None or recv is None or any(
                    b is None or (a is None and i) for i, (a, b) in enumerate(times)):
                continue
            n += 1
            late += recv > ready
            for (label, _, _), (a, b) in zip(ROUND_STAGES, times):
                per[label].append(b - (max(ready, recv) if a is None else a))
    if not n:
        return {}
    return {**{label: _stats(xs) for label, xs in per.items()},
            "coordinator late": {"rounds": late, "of": n}}


def slowest(folder: Path, n: int) -> list[dict[str, Any]]:
    """The `n` longest intervals between the coordinator's sends of consecutive steps, with
    what the step before did in them: its kind, rows and sequences, its total and its three
    longest stages (where a stall lies: a capture or compile on first use, a wait)."""
    out = []
    for events, kinds, shards, sent in load(folder):
        coord = events["coordinator"]
        order = sorted((c["send"], sid) for sid, c in coord.items() if "send" in c)
        for (t0, a), (t1, b) in zip(order, order[1:]):
            st = stages(events, shards, a)
            top = sorted(((v, k) for k, v in st.items() if k != "total"), reverse=True)[:3]
            out.append({"interval_ms": 1000 * (t1 - t0), "sid": a, "kind": kinds.get(a, "?"),
                        "next": kinds.get(b, "?"), "rows": sent.get(a, {}).get("rows"),
                        "seqs": sent.get(a, {}).get("seqs"),
                        "total_ms": 1000 * st["total"] if "total" in st else None,
                        "stages_ms": {k: round(1000 * v, 2) for v, k in top}})
    return sorted(out, key=lambda r: -r["interval_ms"])[:n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--slowest", type=int, default=0, help="list the N longest intervals "
                   "between consecutive steps' sends, and where the step before spent them")
    args = p.parse_args()
    got = summary(args.folder)
    if not got:
        print(f"no steps in {args.folder} (was LAYERSPLIT_STEP_TRACE set for the run?)",
              file=sys.stderr)
        return 1
    for kind, by in sorted(got.items()):
        _table(f"{kind} steps", "steps", by)
    path = rounds(args.folder)
    if path:
        _table("one sequence's speculating rounds, along their critical path", "rounds",
               {k: v for k, v in path.items() if k != "coordinator late"})
        late = path["coordinator late"]
        print(f"(the coordinator's step came after the proposal in {late['rounds']} of "
              f"{late['of']} rounds)")
    full = flow(args.folder)
    print("\nhow full the chain was")
    print("| | value |\n|---|---:|")
    for kind, by in full.items():
        for label, v in by.items():
            print(f"| {kind}: {label} | {v:.3f} |")
    slow = slowest(args.folder, args.slowest) if args.slowest else []
    if slow:
        print(f"\nthe {len(slow)} longest intervals between steps' sends")
        print("| ms | step (sid) | rows / seqs | its total ms | its longest stages (ms) | next |")
        print("|---:|---|---|---:|---|---|")
        for r in slow:
            total = "-" if r["total_ms"] is None else f"{r['total_ms']:.2f}"
            longest = ", ".join(f"{k} {v}" for k, v in r["stages_ms"].items())
            print(f"| {r['interval_ms']:.2f} | {r['kind']} ({r['sid']}) | {r['rows']} / "
                  f"{r['seqs']} | {total} | {longest} | {r['next']} |")
    if args.json is not None:
        args.json.write_text(json.dumps({**got, "rounds": path, "flow": full, "slowest": slow},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
