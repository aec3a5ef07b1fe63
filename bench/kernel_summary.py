"""What each process's device did while it was profiled (`LAYERSPLIT_KERNEL_PROFILE`,
`shards/kernel_profile.py`): per trace, its profiled steps' span, the time its GPU kernels ran
(summed, and as the union of their intervals, "busy"), their count, and its costliest kernels.
Where the traces hold no GPU kernel (a CPU run), the same for torch's CPU operators.

    LAYERSPLIT_KERNEL_PROFILE=/tmp/kprof:200:100 python3 bench/speculative.py ... --streams 8
    python3 bench/kernel_summary.py /tmp/kprof [--top 12] [--json out.json] [--steps 100]

`--steps N` (the STEPS of the profile) also gives each trace's figures per step: kernels, busy
and span, the gap between them (what the device waited on its host), and the costliest kernels'
launches and time per step.

Processes that share one GPU time-slice it: when their busy times add up to about the span of
the steps, the device is the bound; when they add up to much less, the steps wait on hosts.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(path: Path, top: int = 12, by_grid: bool = False) -> dict:
    """One trace's numbers (µs); `by_grid`: a kernel's launches apart by their grid and block
    (one kernel's calls at several widths, each its own row)."""
    try:
        events = json.loads(path.read_text()).get("traceEvents", [])
    except (OSError, ValueError) as e:  # (a process stopped while it wrote its profile)
        return {"trace": path.name, "kind": f"unreadable: {e}", "span_us": 0.0, "ops": 0}
    timed = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    kind = "kernel"
    ops = [e for e in timed if e.get("cat") == "kernel"]
    if not ops:
        kind = "cpu_op"
        ops = [e for e in timed if e.get("cat") == "cpu_op"]
    if not timed:
        return {"trace": path.name, "kind": kind, "span_us": 0.0, "ops": 0}
    span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in ops:  # (grouped by the whole name: cut only for the table, below)
        name = e.get("name", "?")
        if by_grid:
            a = e.get("args", {})
            name = (name, f" grid {a.get('grid')} block {a.get('block')}")
        by_name[name].append(e["dur"])
    costly = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    costly = [(n[0][:90] + n[1] if isinstance(n, tuple) else n[:90], d) for n, d in costly]
    return {"trace": path.name, "kind": kind, "span_us": span, "ops": len(ops),
            "summed_us": sum(e["dur"] for e in ops),
            "busy_us": _union([(e["ts"], e["ts"] + e["dur"]) for e in ops]),
            "top": [{"name": name, "count": len(d), "total_us": sum(d)} for name, d in costly]}


def per_step(got: dict, steps: int) -> dict:
    """`summarize`'s figures of a trace of `steps` steps, per step (µs): kernels, summed,
    busy, span, gap (span less busy), and each costly kernel's launches and time."""
    n = max(steps, 1)
    return {"steps": steps, "kernels": got["ops"] / n, "summed_us": got.get("summed_us", 0) / n,
            "busy_us": got.get("busy_us", 0) / n, "span_us": got["span_us"] / n,
            "gap_us": (got["span_us"] - got.get("busy_us", 0)) / n,
            "top": [{"name": t["name"], "per_step": t["count"] / n,
                     "us_per_step": t["total_us"] / n} for t in got.get("top", [])]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--steps", type=int, default=0,
                   help="the steps each trace holds (LAYERSPLIT_KERNEL_PROFILE's STEPS): "
                        "figures per step as well")
    args = p.parse_args()
    traces = sorted(args.folder.glob("*.json"))
    if not traces:
        print(f"no traces in {args.folder} (was LAYERSPLIT_KERNEL_PROFILE set for the run, and "
              "did each process run more than SKIP steps?)", file=sys.stderr)
        return 1
    got = [summarize(t, args.top) for t in traces]
    print("| trace | what | span ms | count | summed ms | busy ms | busy / span |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for g in got:
        span = g["span_us"] / 1000
        busy = g.get("busy_us", 0) / 1000
        print(f"| {g['trace']} | {g['kind']} | {span:.1f} | {g['ops']} | "
              f"{g.get('summed_us', 0) / 1000:.1f} | {busy:.1f} | "
              f"{busy / span if span else 0:.2f} |")
    for g in got:
        print(f"\n{g['trace']}: costliest {g['kind']}s")
        print("| name | count | total ms |\n|---|---:|---:|")
        for t in g.get("top", []):
            print(f"| `{t['name']}` | {t['count']} | {t['total_us'] / 1000:.2f} |")
    if args.steps > 0:
        for g in got:
            s = per_step(g, args.steps)
            g["per_step"] = s
            print(f"\n{g['trace']}: per step ({args.steps} steps): {s['kernels']:.0f} "
                  f"{g['kind']}s, busy {s['busy_us'] / 1000:.3f} ms, span "
                  f"{s['span_us'] / 1000:.3f} ms, gap {s['gap_us'] / 1000:.3f} ms")
            print("| name | per step | µs per step |\n|---|---:|---:|")
            for t in s["top"]:
                print(f"| `{t['name']}` | {t['per_step']:.1f} | {t['us_per_step']:.1f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
