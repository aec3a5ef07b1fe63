"""The cost of structured output: decode tok/s of one stream constrained by a JSON schema (an
llguidance grammar, its mask computed on the coordinator between steps and applied by the last
shard) against the same stream as free text, on the default model.

    python3 bench/structured_output.py --devices cpu,cpu --new-tokens 96 --repeats 3

Each mode runs `--repeats` times after one warm-up; the median decode tok/s is reported, with
the mean time the coordinator spent computing one mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.decoding import Decoding  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.runtime.grammar import GrammarCompiler, SequenceGrammar  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

# long enough that the output runs to max_tokens in either mode
SCHEMA = {"type": "object", "properties": {
    "people": {"type": "array", "minItems": 40, "items": {
        "type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                "maximum": 120},
            "role": {"enum": ["engineer", "doctor", "teacher", "artist"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
PROMPT = "List forty people with their name, age and job, as JSON."


class TimedGrammar:
    """A SequenceGrammar that keeps the time its masks took."""

    def __init__(self, inner: SequenceGrammar, times: list[float]) -> None:
        self.inner, self.times = inner, times

    def mask(self, generated):
        t0 = time.perf_counter()
        try:
            return self.inner.mask(generated)
        finally:
            self.times.append(time.perf_counter() - t0)


def run(coord: Coordinator, prompt: list[int], decoding: Decoding | None, n: int) -> dict:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    progress = Progress()
    req = coord.submit(prompt, params, progress, use_cache=False, speculative=False,
                       decoding=decoding)
    res = collect(coord.deltas(req), progress, len(prompt))
    return {"tokens": len(res.tokens), "decode_tok_s": res.decode_tok_s, "text": res.text}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                        threads=args.threads, draft="none", max_seqs=1, max_context=1024)
    out = {"devices": args.devices, "new_tokens": args.new_tokens}
    with Coordinator(cfg) as coord:
        tok = coord.tokenizer
        prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
        t0 = time.perf_counter()
        comp = GrammarCompiler(tok, coord.model_config.vocab_size, coord.eos_ids)
        grammar = comp.json_schema(SCHEMA)
        out["grammar_setup_s"] = round(time.perf_counter() - t0, 3)
        times: list[float] = []
        modes = {"free": None, "json_schema": Decoding(
            grammar=lambda: TimedGrammar(comp.matcher(grammar), times))}
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for mode, dec in modes.items():
            run(coord, prompt, dec, 8)  # warm-up
        for _ in range(args.repeats):  # alternated: a load that comes and goes hits both
            for mode, dec in modes.items():
                runs[mode].append(run(coord, prompt, dec, args.new_tokens))
        for mode, rs in runs.items():
            out[mode] = {"decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rs),
                                               2),
                         "runs": [round(r["decode_tok_s"], 2) for r in rs],
                         "tokens": rs[0]["tokens"], "sample": rs[0]["text"][:80]}
        out["json_schema"]["mask_ms_mean"] = round(1e3 * statistics.mean(times), 3)
        out["slowdown"] = round(out["free"]["decode_tok_s"] /
                                out["json_schema"]["decode_tok_s"], 3)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
