"""Prefix sharing in device memory: N requests on one long prefix (8 agents on one
30K-token system prompt), the first running when the others come. The others take the first's
blocks for the prefix by reference (`BlockManager.fork`; `docs/batching.md`, "Prefix sharing")
and prefill only their own suffix.

    python bench/shared_prefix.py --model random:qwen3-8b --devices cuda:0 --prefix 30720 \\
        --requests 8 --kv-cache-gb 24

Reports, once all N are admitted: the KV blocks (and GB, over all shards) they hold, against
what N separate copies would hold; then the followers' TTFT next to the first's (a follower
prefills only its suffix), and that every request ran to its last token.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.runtime.config import RuntimeConfig  # noqa: E402
from layersplit.runtime.coordinator import Coordinator  # noqa: E402
from layersplit.runtime.generate import Progress  # noqa: E402
from layersplit.shards.sampling import SamplingParams  # noqa: E402

from bench.concurrency import prompt_ids  # noqa: E402

log = logging.getLogger("shared_prefix")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--prefix", type=int, default=30720)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=0.0)
    ap.add_argument("--prefill-chunk", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = RuntimeConfig(model=args.model, devices=tuple(args.devices.split(",")),
                        dtype=args.dtype, max_seqs=args.requests, draft="none",
                        prefix_cache=False, kv_cache_gb=args.kv_cache_gb,
                        max_context=args.prefix + args.suffix + args.new_tokens + 8,
                        **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}))
    with Coordinator(cfg) as c:
        vocab = c.model_config.vocab_size
        prefix = prompt_ids(args.prefix, vocab, seed=5)
        prompts = [prefix + prompt_ids(args.suffix, vocab, seed=100 + i)
                   for i in range(args.requests)]
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        progress = [Progress()]
        reqs = [c.submit(prompts[0], params, progress[0])]
        while not progress[0].generated:  # the first one's prefill is done: it decodes
            c.batcher.run_once()
        progress += [Progress() for _ in prompts[1:]]  # (TTFT counts from here)
        reqs += [c.submit(p, params, pr) for p, pr in zip(prompts[1:], progress[1:])]
        while any(r.slot < 0 for r in reqs):  # all admitted
            c.batcher.run_once()
        pool = c.batcher.sched.pool
        held = len({b for t in pool.tables.values() for b in t})
        separate = sum(len(t) for t in pool.tables.values())
        per_block = sum(s.get("kv_bytes", 0) for s in c.shard_info()) / (pool.num_blocks + 1)
        shared = c.batcher.stats.shared_tokens
        while not all(r.done for r in reqs):
            c.batcher.run_once()
        ok = all(len(p.generated) == args.new_tokens for p in progress)
        first, rest = progress[0].ttft_s, [p.ttft_s for p in progress[1:]]
    print(f"\n{args.model} on {args.devices}: {args.requests} requests on one "
          f"{args.prefix}-token prefix (+{args.suffix} tokens each), block of "
          f"{pool.block_tokens} tokens")
    print(f"- KV blocks held once all are admitted: {held} ({held * per_block / 1e9:.2f} GB), "
          f"against {separate} ({separate * per_block / 1e9:.2f} GB) as separate copies: "
          f"{separate / held:.2f} x less; tokens taken by reference: {shared}")
    print(f"- TTFT: first {first:.3f} s; the others median {statistics.median(rest):.3f} s "
          f"(runs {', '.join(f'{t:.3f}' for t in rest)})")
    print(f"- every request generated its {args.new_tokens} tokens: {ok}")


if __name__ == "__main__":
    main()
