"""Start-up of the split runtime: from `Coordinator.start()` to every shard ready, the first
answer, and close, with the CPU time the shard processes spent, for one config.

    python bench/startup.py --model default --devices cpu,cpu --repeats 5

Each repeat starts a fresh coordinator (new shard processes), generates `--new-tokens` tokens
of a short prompt (the first answer: its time to first token and decode speed), then the same
again (the steady state, for the ratio), and closes. Prints the median and the runs of each
column; `--json FILE` writes them. `command_to_first_token_s` adds the interpreter's start and
imports (measured once, from the process's start) to the first repeat's ready time and TTFT:
what `layersplit generate` costs a user. The first repeat on a fresh machine compiles; later
repeats (new processes) find the compile caches under $LAYERSPLIT_HOME warm.

    python bench/startup.py --model random:smollm2-135m-shape --devices cuda:0 --repeats 4 \
        --new-tokens 128 --max-context 2048   # GPU: --capture-at-start off for the old way
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

# the interpreter's start and the imports above, before main() runs (what a command pays first)
START_S = time.time() - psutil.Process(os.getpid()).create_time()


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one(cfg: RuntimeConfig, new_tokens: int) -> dict[str, float]:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    coord = Coordinator(cfg)
    coord.start()
    ready = time.perf_counter()
    try:
        prompt = list(range(10, 40)) if coord.tokenizer is None else \
            coord.tokenizer.encode("How long does a start take?")
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        first = coord.generate(prompt, params, use_cache=False)
        answered = time.perf_counter()
        steady = coord.generate(prompt, params, use_cache=False)
    finally:
        coord.close()
    closed = time.perf_counter()
    return {"ready_s": ready - t0, "first_ttft_s": first.ttft_s,
            "first_answer_s": answered - ready, "first_decode_tok_s": first.decode_tok_s,
            "steady_decode_tok_s": steady.decode_tok_s,
            "first_vs_steady": first.decode_tok_s / max(steady.decode_tok_s, 1e-9),
            "close_s": closed - answered, "shard_cpu_s": _children_cpu() - cpu0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--capture-at-start", default="on", choices=["on", "off"])
    ap.add_argument("--max-seqs", type=int, default=None,
                    help="KV slots (default: the config's 8; `layersplit generate` runs with 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                        threads=args.threads, max_context=args.max_context, prefix_cache=False,
                        capture_at_start=args.capture_at_start == "on",
                        **({} if args.max_seqs is None else {"max_seqs": args.max_seqs}))
    runs = [one(cfg, args.new_tokens) for _ in range(args.repeats)]
    first = START_S + runs[0]["ready_s"] + runs[0]["first_ttft_s"]
    out = {k: {"median": statistics.median(r[k] for r in runs), "runs": [r[k] for r in runs]}
           for k in runs[0]}
    for k, v in out.items():
        print(f"{k:26s} median {v['median']:.3f}  runs " + ", ".join(f"{x:.3f}" for x in v["runs"]))
    # later repeats: new processes that find the compile caches the first one filled
    warm = START_S + statistics.median(r["ready_s"] + r["first_ttft_s"] for r in runs[1:]) \
        if len(runs) > 1 else None
    print(f"command_to_first_token_s   {first:.3f} (start and imports {START_S:.3f} + the first "
          "repeat's ready time and TTFT)")
    if warm is not None:
        print(f"  with warm caches         {warm:.3f} (the same with the later repeats' median)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out,
                                               "command_to_first_token_s": first,
                                               "command_to_first_token_warm_s": warm,
                                               "start_and_imports_s": START_S}, indent=1))


if __name__ == "__main__":
    main()
