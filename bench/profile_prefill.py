"""Where a chunked prefill's time goes, in one process (no IPC): a long prompt prefilled in
chunks of each given size, wall time next to the GPU's busy time, and the torch profiler's
kernel table of the smallest chunk size (what chunking adds over one piece).

    python bench/profile_prefill.py --model random:qwen3-8b --tokens 32768 --chunks 2048,32768

Loads the whole model on one GPU the way a shard does (fused projections, a paged KV pool).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from layersplit.shards.checkpoint import load_layer_range, open_checkpoint  # noqa: E402
from layersplit.shards.executor import RangeExecutor  # noqa: E402
from layersplit.shards.fused import fuse_projections  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

BLOCK = 16


def prefill(ex: RangeExecutor, ids: torch.Tensor, chunk: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a in range(0, ids.shape[0], chunk):
        ex.run(ids[a:a + chunk], a)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunks", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    model = load_layer_range(ckpt, 0, cfg.num_layers, torch.bfloat16, "cuda:0")
    fuse_projections(model, compile=True)
    blocks = -(-args.tokens // BLOCK)
    ex = RangeExecutor(model, blocks * BLOCK, device="cuda:0", paged=(blocks, BLOCK))
    ex.kv.set_table(0, 0, list(range(blocks)))
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), device="cuda:0")
    chunks = sorted(int(c) for c in args.chunks.split(","))
    for c in chunks:
        prefill(ex, ids, c)  # warm-up
        runs = [prefill(ex, ids, c) for _ in range(args.repeats)]
        print(f"chunk {c}: {statistics.median(runs):.3f} s (runs "
              + ", ".join(f"{r:.3f}" for r in runs) + ")", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = prefill(ex, ids, chunks[0])
    ka = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ka) / 1e6
    print(ka.table(sort_by="self_device_time_total", row_limit=25))
    print(f"chunk {chunks[0]} under the profiler: wall {wall:.3f} s, GPU busy {gpu:.3f} s")


if __name__ == "__main__":
    main()
