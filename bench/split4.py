"""A 32B-shape model split 4 ways, 2 ways and unsplit, in one run (issue: a 4-GPU split).

    python3 bench/split4.py --part decode   # decode tok/s per layout, per-hop overhead
    python3 bench/split4.py --part cache    # a disk entry written 2-way restores 4-way

`decode`: batch 1, a 512-token prompt, 256 new tokens, greedy, through the real runtime on
`cuda:0`, `cuda:0,1` and `cuda:0,1,2,3` (`auto` picks cuda-ipc between GPUs). The per-hop
overhead is the extra time per decoded token of a split layout over the unsplit one, divided by
its hops.

`cache`: the 2-way run prefills the prompt with a disk cache directory and decodes; after it
shuts down, a 4-way run on the same directory restores the prompt from disk (no prefill) and
must decode the same greedy tokens; a cold 4-way run (cache off) is the third column.

Prints a table last; `--json FILE` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode  # noqa: E402  (bench/decode.py: one layout through the runtime)
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.model_store import resolve_model  # noqa: E402
from layersplit.shards.checkpoint import open_checkpoint  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402


def vocab(model: str) -> int:
    return open_checkpoint(resolve_model(model)).config.vocab_size

LAYOUTS = ("cuda:0", "cuda:0,cuda:1", "cuda:0,cuda:1,cuda:2,cuda:3")


def part_decode(args) -> list[dict]:
    ns = argparse.Namespace(model=args.model, max_context=args.max_context, prefill_chunk=512,
                            transport="auto", no_graphs=False, dtype="auto", threads=None,
                            new_tokens=args.new_tokens, repeats=args.repeats, prefill=[])
    prompt = decode.prompt_ids(args.prompt_len, vocab(args.model))
    rows = []
    for layout in args.layouts:
        devices = layout.split(",")
        rows.append(decode.run_layout(ns, devices, prompt))
        print(f"{layout}: {rows[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    step1 = 1 / rows[0]["decode_tok_s"]
    for r in rows:
        hops = r["shards"] - 1
        r["vs_unsplit"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
        r["hop_overhead_us"] = (1 / r["decode_tok_s"] - step1) / hops * 1e6 if hops else None
    print(f"\n{args.model}, batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print("| layout | transport | TTFT ms | decode tok/s | vs unsplit | per-hop overhead |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        hop = "-" if r["hop_overhead_us"] is None else f"{r['hop_overhead_us']:.0f} µs"
        print(f"| {r['layout']} | {r['transport']} | {r['ttft_s'] * 1000:.1f} | "
              f"{r['decode_tok_s']:.1f} | {r['vs_unsplit']:.3f} | {hop} |")
    same = [r["tokens"] == rows[0]["tokens"] for r in rows]
    print(f"first 16 greedy tokens equal to the unsplit run's: {same}")
    return rows


def part_cache(args) -> list[dict]:
    prompt = decode.prompt_ids(args.prompt_len, vocab(args.model), seed=7)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.cache_parent) as d:
        def cfg(layout: str) -> RuntimeConfig:
            return RuntimeConfig(model=args.model, devices=tuple(layout.split(",")),
                                 max_context=args.max_context, prefill_chunk=512,
                                 kv_cache_dir=d)
        with Coordinator(cfg(args.layouts[1])) as c:
            r = c.generate(prompt, params)
            rows.append({"run": "2-way, cold, writes the entry", "tier": r.cache_tier,
                         "cached": r.cached_tokens, "ttft_ms": r.ttft_s * 1000,
                         "tokens": r.tokens})
        files = sorted(Path(d).glob("*.safetensors"))
        with Coordinator(cfg(args.layouts[2])) as c:
            r = c.generate(prompt, params)
            rows.append({"run": "4-way, restored from the 2-way entry", "tier": r.cache_tier,
                         "cached": r.cached_tokens, "ttft_ms": r.ttft_s * 1000,
                         "tokens": r.tokens})
            r = c.generate(prompt, params, use_cache=False)
            rows.append({"run": "4-way, cold (cache off)", "tier": r.cache_tier,
                         "cached": r.cached_tokens, "ttft_ms": r.ttft_s * 1000,
                         "tokens": r.tokens})
    print(f"\n{args.model}: {args.prompt_len}-token prompt, 32 greedy tokens; entry files "
          f"written by the 2-way run: {[f.name[:12] for f in files]}")
    print("| run | cache tier | cached tokens | TTFT ms | same tokens as the 2-way run |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['run']} | {r['tier']} | {r['cached']} | {r['ttft_ms']:.1f} | "
              f"{r['tokens'] == rows[0]['tokens']} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("decode", "cache"), required=True)
    p.add_argument("--model", default="random:qwen3-32b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cache-parent", default=None, help="where the cache directory goes")
    p.add_argument("--layouts", nargs=3, default=LAYOUTS, help="unsplit, 2-way, 4-way")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows = part_decode(args) if args.part == "decode" else part_cache(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
