"""Parity with transformers on a GPU: the figures of RESULTS.md's correctness table.

    python3 bench/parity.py default  --out parity_default.json   # the default model, every layout
    python3 bench/parity.py families --out parity_families.json  # reduced shapes of each family

Each model's float32 transformers run is made once and every layout is checked against it
(`layersplit check`'s measures, `runtime.check`); transformers' own bfloat16 and float16 are
measured against the same float32 run, so our half types stand next to theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layersplit.runtime.check import CheckOptions, reference_runs, run_check  # noqa: E402
from layersplit.runtime.check_reference import ReferenceRun, half_agreement  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402

log = logging.getLogger("parity")
QUESTION = "What is the capital of France?"


def ours(cfg: RuntimeConfig, opts: CheckOptions, refs: list[ReferenceRun], name: str) -> dict:
    t0 = time.perf_counter()
    r = run_check(cfg, opts, refs)
    row = {"who": f"layersplit {name}", "dtype": r["dtype"], "split": r["split"],
           "positions": r["positions"], "top1_agreement": r["top1_agreement"],
           "mean_kl": r["mean_kl"], "max_kl": r["max_kl"],
           "max_abs_logit_diff": r["max_abs_logit_diff"],
           "nonfinite_positions": r["nonfinite_positions"], "greedy_equal": r["greedy_equal"],
           "prompts": r["prompts"], "pass": r["pass"], "failures": r["failures"],
           "seconds": round(time.perf_counter() - t0, 1)}
    for k, run in r["runs"].items():
        if k != "plain":
            row[k] = {x: run[x] for x in ("greedy_equal", "equal_plain", "equal_cold",
                                          "restored") if x in run}
    return row


def emit(rows: list[dict], out: str | None, extra: dict) -> None:
    doc = {**extra, "rows": rows}
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))
    for r in rows:
        fields = [r["who"], r.get("dtype", ""), " ".join(r.get("split", [])),
                  f"top1 {r['top1_agreement']:.4f}", f"meanKL {r['mean_kl']:.2e}"
                  if isinstance(r["mean_kl"], float) else f"meanKL {r['mean_kl']}",
                  f"greedy {r['greedy_equal']}/{r['prompts']}"]
        fields += [f"{k} {r[k]}" for k in ("speculative", "ram", "disk") if k in r]
        print(" | ".join(str(f) for f in fields), flush=True)


def cmd_default(args) -> None:
    dev = args.device
    base = RuntimeConfig(model="default", devices=(dev,), max_context=1024, draft="none")
    opts = CheckOptions(limit=args.limit, new_tokens=args.new_tokens)
    model, refs, stop = reference_runs(base, opts, dev)
    rows: list[dict] = []
    for dtype in ("bfloat16", "float16"):
        rows.append(half_agreement(model, refs, dtype, dev, opts.new_tokens, stop))
        emit(rows, args.out, {"model": model})
    two = ("cuda:0", "cuda:1") if args.gpus > 1 else (dev, dev)
    variants = [
        ("1-shard", base, opts),
        ("1-shard-bfloat16", dataclasses.replace(base, dtype="bfloat16"), opts),
        ("1-shard-float32", dataclasses.replace(base, dtype="float32"), opts),
        ("2-shards", dataclasses.replace(base, devices=two), opts),
        ("1-shard-eager", dataclasses.replace(base, cuda_graphs=False), opts),
        ("1-shard-draft", dataclasses.replace(base, draft="default"), opts),
        ("2-shards-batch8-restore", dataclasses.replace(base, devices=two),
         dataclasses.replace(opts, batch=8, restore=("ram", "disk"))),
    ]
    if args.variants:
        known = {n for n, _, _ in variants}
        wanted = args.variants.split(",")
        for w in wanted:
            if w not in known:
                raise SystemExit(f"unknown variant {w!r} (known: {', '.join(sorted(known))})")
        variants = [v for v in variants if v[0] in wanted]
    # the auto-dtype layout `--repeat` times (its figures are medians of several runs)
    variants = [(f"{n} #{i + 1}" if n == "1-shard" and args.repeat > 1 else n, c, o)
                for n, c, o in variants for i in range(args.repeat if n == "1-shard" else 1)]
    for name, cfg, o in variants:
        try:
            rows.append(ours(cfg, o, refs, name))
        except Exception as e:  # noqa: BLE001 - the row says what failed; the others go on
            log.exception("%s failed", name)
            rows.append({"who": f"layersplit {name}", "error": repr(e)[:500],
                         "top1_agreement": 0.0, "mean_kl": "error", "greedy_equal": 0,
                         "prompts": len(refs)})
        emit(rows, args.out, {"model": model})
    answers = question(dev, two) if args.question else []
    emit(rows, args.out, {"model": model, "question": answers})
    for a in answers:
        print(f"{a['layout']}: {a.get('text', a.get('error'))!r} ({a.get('dtype')})")


def question(dev: str, two: tuple[str, str]) -> list[dict]:
    """The README's question through `layersplit generate`, in each layout, draft on and off."""
    out = []
    for devices in (dev, ",".join(two)):
        for draft in ("auto", "none"):
            cmd = [sys.executable, "-m", "layersplit.launch.cli", "generate", QUESTION, "--chat",
                   "--devices", devices, "--draft", draft, "--max-tokens", "24", "--json"]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            row = {"layout": f"{devices} draft {draft}"}
            try:
                j = json.loads(p.stdout.strip().splitlines()[-1])
                row.update(text=j["text"], dtype=j.get("dtype"),
                           acceptance=j.get("acceptance_length"))
            except (ValueError, IndexError, KeyError):
                row["error"] = p.stderr[-400:]
            out.append(row)
    return out


def cmd_families(args) -> None:
    from layersplit.shards.shape_checkpoints import SHAPES, write_shape_checkpoint

    rows: list[dict] = []
    root = Path(args.dir)
    for fam in args.families.split(","):
        if fam not in SHAPES:
            raise SystemExit(f"unknown family {fam!r} (known: {', '.join(SHAPES)})")
        t0 = time.perf_counter()
        dev = args.device
        path = write_shape_checkpoint(root / fam, fam, dev)
        log.info("%s written in %.1f s", fam, time.perf_counter() - t0)
        cfg = RuntimeConfig(model=str(path), devices=(dev,), max_context=512,
                            draft="none", dtype=args.dtype)
        opts = CheckOptions(limit=args.limit, new_tokens=args.new_tokens)
        try:
            model, refs, stop = reference_runs(cfg, opts, dev)
            half = half_agreement(model, refs, args.dtype, dev, opts.new_tokens, stop)
            rows.append({**half, "family": fam})
            rows.append({**ours(cfg, opts, refs, fam), "family": fam})
        except Exception as e:  # noqa: BLE001 - the row says what failed; the others go on
            log.exception("%s failed", fam)
            rows.append({"who": f"layersplit {fam}", "family": fam, "error": repr(e)[:500],
                         "top1_agreement": 0.0, "mean_kl": "error", "greedy_equal": 0,
                         "prompts": 0})
        emit(rows, args.out, {"dtype": args.dtype})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("default")
    d.add_argument("--limit", type=int, default=None)
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--gpus", type=int, default=1, help="2: the 2-shard layouts on 2 GPUs")
    d.add_argument("--device", default="cuda:0")
    d.add_argument("--out", default=None)
    d.add_argument("--variants", default=None,
                   help="a comma-separated subset of the layouts, by name (default: all)")
    d.add_argument("--repeat", type=int, default=1,
                   help="the auto-dtype 1-shard layout this many times (medians of several runs)")
    d.add_argument("--no-question", dest="question", action="store_false",
                   help="skip the README's question through `layersplit generate`")
    f = sub.add_parser("families")
    f.add_argument("--families", default="llama,qwen3_5,qwen3_moe,gemma3,mistral,qwen3")
    f.add_argument("--dir", default=os.environ.get("LAYERSPLIT_SHAPES", "/tmp/shapes"))
    f.add_argument("--dtype", default="bfloat16")
    f.add_argument("--device", default="cuda:0",
                   help="cpu: the same figures from the CPU path (a FOLDER/FAMILY made "
                        "beforehand, e.g. narrower, is used as it is)")
    f.add_argument("--limit", type=int, default=8)
    f.add_argument("--new-tokens", type=int, default=64)
    f.add_argument("--out", default=None)
    args = p.parse_args()
    {"default": cmd_default, "families": cmd_families}[args.cmd](args)


if __name__ == "__main__":
    main()
