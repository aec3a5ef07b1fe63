"""Many streams at once (continuous batching with micro-batches in flight), and one long prompt's
prefill, on several layouts in one run.

For each layout (e.g. 1 GPU unsplit, 2 shards on 2 GPUs) and each number of concurrent streams:
aggregate decode tok/s (every stream's generated tokens over the wall time from the moment all
of them have their first token to the last one's end), the p50/p99 inter-token latency, and how
busy each shard was meanwhile (the seconds each spent on steps, which end when the step's output
has left the device, over the wall time). Then the prefill of one long prompt (TTFT, a single
token out): its chunks flow through the shards overlapped.

    python3 bench/concurrency.py --model random:qwen3-8b --layouts cuda:0 cuda:0,cuda:1 \\
        --streams 1,2,4,8,16 --prefill-len 32768

Mixed load (`--mixed 65536x1,2048x15`): streams of different prompt lengths decoding together
(one long conversation beside short requests, over the paged KV pool: `--kv-cache-gb`), next
to as many streams of `--prompt-len` tokens each, in the same runtime:

    python3 bench/concurrency.py --model random:qwen3-8b --layouts cuda:0 \\
        --mixed 65536x1,2048x15 --prompt-len 2048 --kv-cache-gb 24 --repeats 3

`--repeats N` measures each load N times after its warm-up and keeps the median run's row
(every run's tok/s and p99s listed in the JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress, collect  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

log = logging.getLogger("bench.concurrency")


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 30000), (n,), generator=g).tolist()


def mixed_lengths(spec: str) -> list[int]:
    """"65536x1,2048x15" -> one 65536 and fifteen 2048."""
    out = []
    for part in spec.split(","):
        length, _, count = part.partition("x")
        out += [int(length)] * int(count or 1)
    return out


def run_streams(coord: Coordinator, streams: int, args,
                lengths: list[int] | None = None) -> dict:
    """`streams` prompts of `args.prompt_len` tokens, or one prompt per entry of `lengths`."""
    vocab = coord.model_config.vocab_size
    lengths = lengths or [args.prompt_len] * streams
    streams = len(lengths)
    prompts = [prompt_ids(n, vocab, seed=1000 * streams + i) for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)] * streams
    busy0, t0 = coord.shard_busy_s(), time.perf_counter()
    progs = [Progress() for _ in prompts]
    results = coord.generate_batch(prompts, params, use_cache=False,
                                   speculative=[False] * streams, progress=progs)
    t1, busy1 = time.perf_counter(), coord.shard_busy_s()
    start = max(p.first_token_at for p in progs)  # every stream decodes from here on
    end = max(p.finished_at for p in progs)
    tokens = sum(sum(1 for t in p.token_times if t > start) for p in progs)
    gaps = sorted(b - a for p in progs for a, b in zip(p.token_times, p.token_times[1:]))
    # once every stream decodes (no prompt's prefill chunks between the steps any more)
    steady = sorted(b - a for p in progs for a, b in zip(p.token_times, p.token_times[1:])
                    if a >= start)
    assert all(len(r.tokens) == args.new_tokens for r in results)
    return {
        "streams": streams, "prompts": "+".join(f"{lengths.count(n)}x{n}"
                                                for n in sorted(set(lengths), reverse=True)),
        "decode_tok_s": tokens / max(end - start, 1e-9),
        "per_stream_tok_s": statistics.mean(r.decode_tok_s for r in results),
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(len(gaps) * 0.99)],
        "steady_itl_p99_ms": 1e3 * steady[int(len(steady) * 0.99)] if steady else float("nan"),
        "busy": [round((b - a) / (t1 - t0), 3) for a, b in zip(busy0, busy1)],
        "wall_s": t1 - t0,
    }


def median_row(rows: list[dict]) -> dict:
    """The run of median aggregate tok/s, with every run's tok/s and p99s listed."""
    ranked = sorted(rows, key=lambda r: r["decode_tok_s"])
    row = dict(ranked[len(ranked) // 2])
    for key in ("decode_tok_s", "itl_p99_ms", "steady_itl_p99_ms"):
        row[f"{key}_runs"] = [r[key] for r in rows]
    return row


def run_layout(args, devices: list[str]) -> dict:
    counts = [int(s) for s in args.streams.split(",")]
    mixed = mixed_lengths(args.mixed) if args.mixed else None
    # (streams, lengths): the mixed load and as many uniform streams, or each count
    runs = [(len(mixed), mixed), (len(mixed), None)] if mixed else [(n, None) for n in counts]
    longest = max(mixed or [args.prompt_len])
    cfg = RuntimeConfig(model=args.model, devices=tuple(devices), dtype=args.dtype,
                        max_context=longest + args.new_tokens + 8,
                        prefill_chunk=args.prefill_chunk, max_seqs=max(n for n, _ in runs),
                        micro_batches=args.micro_batches, draft="none", prefix_cache=False,
                        kv_cache_gb=args.kv_cache_gb)
    out: dict = {"layout": ",".join(devices), "rows": []}
    with Coordinator(cfg) as coord:
        out["micro_batches"] = coord.batcher.sched.config.micro_batches
        for n, lengths in runs:
            run_streams(coord, n, args, lengths)  # warm-up: captures this batch size's graphs
            row = median_row([run_streams(coord, n, args, lengths)
                              for _ in range(args.repeats)])
            log.info("%s, %s: %.1f tok/s, p99 ITL %.2f ms, busy %s", out["layout"],
                     row["prompts"], row["decode_tok_s"], row["itl_p99_ms"], row["busy"])
            out["rows"].append(row)
    if args.prefill_len:
        cfg = RuntimeConfig(model=args.model, devices=tuple(devices), dtype=args.dtype,
                            max_context=args.prefill_len + 8, prefill_chunk=args.prefill_chunk,
                            max_seqs=1, draft="none", prefix_cache=False)
        with Coordinator(cfg) as coord:
            prompt = prompt_ids(args.prefill_len, coord.model_config.vocab_size, seed=7)
            one = SamplingParams(max_tokens=1, ignore_eos=True)
            times = []
            for _ in range(3):
                p = Progress()
                collect(coord.stream(prompt, one, p, use_cache=False), p, len(prompt))
                times.append(p.ttft_s)
            out["prefill_s"] = min(times[1:])
            out["prefill_in_flight"] = coord.batcher.stats.most_in_flight
            log.info("%s: prefill of %d tokens %.3f s", out["layout"], args.prefill_len,
                     out["prefill_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--layouts", nargs="+", default=["cuda:0", "cuda:0,cuda:1"])
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=0)
    ap.add_argument("--mixed", default="", help="prompt lengths decoding together, e.g. "
                    "65536x1,2048x15, next to as many streams of --prompt-len")
    ap.add_argument("--kv-cache-gb", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measured runs of each load after its warm-up (the median's row)")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    layouts = [run_layout(args, lay.split(",")) for lay in args.layouts]
    base = {r["prompts"]: r["decode_tok_s"] for r in layouts[0]["rows"]}
    print(f"\nmodel {args.model}, {args.new_tokens} new tokens each")
    print("| layout | micro-batches | prompts | aggregate tok/s | vs first row | vs first layout "
          "| p50 / p99 ITL ms | p99 once all decode | shard busy |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for lay in layouts:
        one = lay["rows"][0]["decode_tok_s"]
        for r in lay["rows"]:
            print(f"| {lay['layout']} | {lay['micro_batches']} | {r['prompts']} | "
                  f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / one:.2f} | "
                  f"{r['decode_tok_s'] / base.get(r['prompts'], float('nan')):.3f} | "
                  f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                  f"{r['steady_itl_p99_ms']:.2f} | "
                  f"{', '.join(f'{b:.0%}' for b in r['busy'])} |")
    if args.prefill_len:
        p0 = layouts[0]["prefill_s"]
        print(f"\nprefill of {args.prefill_len} tokens, chunks of {args.prefill_chunk}:")
        for lay in layouts:
            rate = args.prefill_len / lay["prefill_s"]
            print(f"- {lay['layout']}: {lay['prefill_s']:.3f} s ({rate:.0f} tok/s, "
                  f"{p0 / lay['prefill_s']:.2f} x the first layout; up to "
                  f"{lay['prefill_in_flight']} steps in flight)")
    if args.json:
        Path(args.json).write_text(json.dumps(layouts, indent=1))


if __name__ == "__main__":
    main()
