"""When is an answer worth keeping in the prefix cache (`keep_answers`)? For answers of several
lengths: the next turn's time to first token with the answer kept (its keep ran between the
turns, timed apart) and without (the next turn prefills the answer with its new message).

    python bench/kept_answers.py --model default --devices cpu,cpu --tails 4,16,64,256

Every trial is a conversation of its own (a shared system prompt, a user message of its own),
the two modes alternate, and the medians of `--repeats` trials are printed, with the keep's
own time. The answers are token ids drawn from the vocabulary's ordinary range and closed by
the end-of-turn token, as the template closes an answer: nothing is decoded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--tails", default="4,16,64,256", help="answer lengths (tokens)")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                        max_context=4096, keep_answers=1)
    rows = []
    with Coordinator(cfg) as coord:
        tok, eos = coord.tokenizer, coord.eos_ids[0]
        rng = random.Random(0)
        system = tok.encode_chat([{"role": "system", "content": "You are an agent. " + " ".join(
            rng.choice(["read", "the", "file", "then", "fix", "tests"])
            for _ in range(args.system_tokens))}], add_generation_prompt=False)
        coord.generate(system + [eos], ONE)  # (cached for every trial)
        trial = 0
        for tail in (int(x) for x in args.tails.split(",")):
            times: dict[str, list[float]] = {"kept": [], "not kept": [], "keep": []}
            for _ in range(args.repeats):
                for mode in ("kept", "not kept"):
                    trial += 1
                    user = tok.encode(f"<|im_start|>user\ntask {trial}: fix the cache "
                                      f"module<|im_end|>\n<|im_start|>assistant\n")
                    prompt = system + user
                    coord.generate(prompt, ONE)  # the turn (its prompt is cached)
                    answer = [rng.randrange(1000, 40000) for _ in range(tail)] + [eos]
                    nxt = prompt + answer + tok.encode(
                        "\n<|im_start|>user\nthe tests pass<|im_end|>\n<|im_start|>assistant\n")
                    if mode == "kept":
                        t0 = time.perf_counter()
                        keep = coord.keep_turn(prompt + answer)
                        for _ in coord.deltas(keep):
                            pass
                        times["keep"].append(time.perf_counter() - t0)
                    r = coord.generate(nxt, ONE)
                    times[mode].append(r.ttft_s)
            row = {"tail": tail, **{k: statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(f"answer {tail:5d} tokens: next turn's TTFT kept {row['kept'] * 1e3:7.1f} ms, "
                  f"not kept {row['not kept'] * 1e3:7.1f} ms; the keep itself "
                  f"{row['keep'] * 1e3:7.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
