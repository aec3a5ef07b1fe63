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


def run_streams(coord: Coordinator, streams: int, args) -> dict:
    vocab = coord.model_config.vocab_size
    prompts = [prompt_ids(args.prompt_len, vocab, seed=1000 * streams + i)
               for i in range(streams)]
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
    assert all(len(r.tokens) == args.new_tokens for r in results)
    return {
        "streams": streams, "decode_tok_s": tokens / max(end - start, 1e-9),
        "per_stream_tok_s": statistics.mean(r.decode_tok_s for r in results),
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(len(gaps) * 0.99)],
        "busy": [round((b - a) / (t1 - t0), 3) for a, b in zip(busy0, busy1)],
        "wall_s": t1 - t0,
    }


def run_layout(args, devices: list[str]) -> dict:
    counts = [int(s) for s in args.streams.split(",")]
    cfg = RuntimeConfig(model=args.model, devices=tuple(devices), dtype=args.dtype,
                        max_context=args.prompt_len + args.new_tokens + 8,
                        prefill_chunk=args.prefill_chunk, max_seqs=max(counts),
                        micro_batches=args.micro_batches, draft="none", prefix_cache=False)
    out: dict = {"layout": ",".join(devices), "rows": []}
    with Coordinator(cfg) as coord:
        out["micro_batches"] = coord.batcher.sched.config.micro_batches
        for n in counts:
            run_streams(coord, n, args)  # warm-up: captures this batch size's graphs
            row = run_streams(coord, n, args)
            log.info("%s, %d streams: %.1f tok/s, p99 ITL %.2f ms, busy %s", out["layout"], n,
                     row["decode_tok_s"], row["itl_p99_ms"], row["busy"])
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
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    layouts = [run_layout(args, lay.split(",")) for lay in args.layouts]
    base = {r["streams"]: r["decode_tok_s"] for r in layouts[0]["rows"]}
    print(f"\nmodel {args.model}, prompt {args.prompt_len}, {args.new_tokens} new tokens each")
    print("| layout | micro-batches | streams | aggregate tok/s | vs 1 stream | vs first layout "
          "| p50 / p99 ITL ms | shard busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for lay in layouts:
        one = lay["rows"][0]["decode_tok_s"]
        for r in lay["rows"]:
            print(f"| {lay['layout']} | {lay['micro_batches']} | {r['streams']} | "
                  f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / one:.2f} | "
                  f"{r['decode_tok_s'] / base.get(r['streams'], float('nan')):.3f} | "
                  f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
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
