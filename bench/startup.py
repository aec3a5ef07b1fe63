"""Start-up of the split runtime: from `Coordinator.start()` to every shard ready, the first
answer, and close, with the CPU time the shard processes spent, for one config.

    python bench/startup.py --model default --devices cpu,cpu --repeats 5

Each repeat starts a fresh coordinator (new shard processes), generates 8 tokens of a short
prompt, and closes. Prints the median and the runs of each column; `--json FILE` writes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one(cfg: RuntimeConfig) -> dict[str, float]:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    coord = Coordinator(cfg)
    coord.start()
    ready = time.perf_counter()
    try:
        prompt = list(range(10, 40)) if coord.tokenizer is None else \
            coord.tokenizer.encode("How long does a start take?")
        coord.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_cache=False)
        answered = time.perf_counter()
    finally:
        coord.close()
    closed = time.perf_counter()
    return {"ready_s": ready - t0, "first_answer_s": answered - ready, "close_s": closed - answered,
            "shard_cpu_s": _children_cpu() - cpu0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                        threads=args.threads, max_context=512, prefix_cache=False)
    runs = [one(cfg) for _ in range(args.repeats)]
    out = {k: {"median": statistics.median(r[k] for r in runs), "runs": [r[k] for r in runs]}
           for k in runs[0]}
    for k, v in out.items():
        print(f"{k:15s} median {v['median']:.3f}  runs " + ", ".join(f"{x:.3f}" for x in v["runs"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))


if __name__ == "__main__":
    main()
