"""The cost of structured output: decode tok/s of one stream constrained by a JSON schema (an
llguidance grammar, its mask computed on the coordinator while the step runs and applied by the
last shard) against the same stream as free text, on the default model, for each layout given.

    python3 bench/structured_output.py --layouts cpu,cpu --new-tokens 96 --repeats 3
    python3 bench/structured_output.py --layouts cuda:0 cuda:0,cuda:0 --new-tokens 256  # GPU

Each mode runs `--repeats` times after one warm-up, the modes alternated; the median decode
tok/s is reported (and each run). Where the grammar's time goes, per token: `mask_ms`, the
coordinator's (consume the token, fill the next mask, pack it), which overlaps the step that
carries the token (the mask follows it to the last shard); `apply_ms`, the last shard's
(`process_logits`: inflate the mask, send it to its device, apply it; on a GPU in the Triton
kernel of `shards.kernels.token_mask`), timed apart on the layout's last device, and
`apply_ms_torch` the same through the torch path (`LAYERSPLIT_FUSED_KERNELS=0`, set in this
process only while it is timed); `share`, the sum of `mask_ms` and `apply_ms` over the free-text
time of a token (what they would cost if nothing overlapped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.decoding import Decoding  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.runtime.grammar import GrammarCompiler, SequenceGrammar  # noqa: E402
from layersplit.shards.dtypes import torch_dtype  # noqa: E402
from layersplit.shards.kernels import ENV_SWITCH as FUSED_SWITCH  # noqa: E402
from layersplit.shards.sampling import SamplingParams, process_logits  # noqa: E402

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


def apply_ms(mask: bytes, vocab: int, device: str, dtype: torch.dtype, n: int = 200,
             kernels: bool = True) -> float:
    """The last shard's cost of one mask: `process_logits` on a logits row of `device`
    (`kernels` False: through the torch path, as with `LAYERSPLIT_FUSED_KERNELS=0`)."""
    if not kernels:
        old = os.environ.get(FUSED_SWITCH)
        os.environ[FUSED_SWITCH] = "0"
        try:
            return apply_ms(mask, vocab, device, dtype, n)
        finally:
            if old is None:
                del os.environ[FUSED_SWITCH]
            else:
                os.environ[FUSED_SWITCH] = old
    dev = torch.device(device)
    row = torch.randn(1, vocab, device=dev).to(dtype)
    sample = {"mask": mask}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(10):
        process_logits(row, sample)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        process_logits(row, sample).argmax()
    sync()
    return 1e3 * (time.perf_counter() - t0) / n


def bench_layout(args, devices: str) -> dict:
    cfg = RuntimeConfig(model=args.model, devices=tuple(devices.split(",")), dtype=args.dtype,
                        threads=args.threads, draft="none", max_seqs=1, max_context=1024)
    out = {"devices": devices, "new_tokens": args.new_tokens}
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
        mask = comp.matcher(grammar).mask([])
        dtype = torch_dtype(coord.dtype)
        free_ms = 1e3 / out["free"]["decode_tok_s"]
        out["mask_ms"] = round(1e3 * statistics.median(times), 3)
        out["apply_ms"] = round(apply_ms(mask, coord.model_config.vocab_size, cfg.devices[-1],
                                         dtype), 3)
        out["apply_ms_torch"] = round(apply_ms(mask, coord.model_config.vocab_size,
                                               cfg.devices[-1], dtype, kernels=False), 3)
        out["token_ms_free"] = round(free_ms, 3)
        out["share"] = round((out["mask_ms"] + out["apply_ms"]) / free_ms, 4)
        out["ratio"] = round(out["json_schema"]["decode_tok_s"] / out["free"]["decode_tok_s"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--layouts", nargs="+", default=["cpu,cpu"],
                    help="device lists, one run each (cuda:0 = 1 shard; cuda:0,cuda:0 = 2 "
                         "shards on one GPU)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # (the apply timing on CPU: as a CPU shard runs)
    results = []
    for layout in args.layouts:
        results.append(bench_layout(args, layout))
        print(json.dumps(results[-1], indent=1), flush=True)
    print(f"{'layout':<16} {'free tok/s':>10} {'schema tok/s':>12} {'ratio':>6} "
          f"{'mask ms':>8} {'apply ms':>8} {'torch ms':>8} {'share':>6}")
    for r in results:
        print(f"{r['devices']:<16} {r['free']['decode_tok_s']:>10} "
              f"{r['json_schema']['decode_tok_s']:>12} {r['ratio']:>6} {r['mask_ms']:>8} "
              f"{r['apply_ms']:>8} {r['apply_ms_torch']:>8} {r['share']:>6}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
