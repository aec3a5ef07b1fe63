"""llama.cpp (llama-cpp-python built with CUDA) on a GGUF file, every layer on the GPU(s), as the
peer in the same call as our own runs: batch-1 decode of 256 tokens after a 512-token prompt
(bench/decode.py's shape) and the prefill rate of a 3,900-token prompt. Reports the wall decode
rate through the Python API and llama.cpp's own eval counters (llama-bench's `tg`).

    CUDA_VISIBLE_DEVICES=0   python bench/llamacpp_decode.py MODEL.gguf --split none
    CUDA_VISIBLE_DEVICES=0,1 python bench/llamacpp_decode.py MODEL.gguf --split layer

Prompts are token ids drawn from the vocabulary (seeded), like bench/decode.py's, so a random-
weights file (bench/random_gguf.py) serves as well as a real one. Building llama-cpp-python on a
GPU machine: bench/README.md (`bash bench/device.sh llamacpp`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--split", default="none", choices=["none", "layer", "row"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=3900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mode = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
            "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}[args.split]
    ctx = max(args.prompt_len + args.new_tokens, args.prefill) + 64
    m = llama_cpp.Llama(model_path=args.gguf, n_ctx=ctx, n_batch=4096, n_ubatch=4096,
                        n_gpu_layers=-1, flash_attn=True, split_mode=mode, verbose=False, seed=0)
    rng = random.Random(0)
    ids = [rng.randrange(100, m.n_vocab()) for _ in range(max(args.prompt_len, args.prefill))]
    row: dict = {"gguf": args.gguf, "split": args.split, "runs": []}
    for _ in range(args.runs + 1):  # the first run warms up
        m.reset()
        llama_cpp.llama_perf_context_reset(m.ctx)
        n, t0, t1 = 0, time.perf_counter(), None
        for _tok in m.generate(ids[:args.prompt_len], temp=0.0, reset=True):
            if t1 is None:
                t1 = time.perf_counter()
            n += 1
            if n > args.new_tokens:
                break
        t2 = time.perf_counter()
        p = llama_cpp.llama_perf_context(m.ctx)
        row["runs"].append({"ttft_ms": 1e3 * (t1 - t0), "wall_tok_s": (n - 1) / (t2 - t1),
                            "eval_tok_s": p.n_eval / (p.t_eval_ms / 1e3) if p.t_eval_ms else None})
    row["warmup"] = row["runs"].pop(0)
    row["wall_tok_s"] = statistics.median(r["wall_tok_s"] for r in row["runs"])
    row["eval_tok_s"] = statistics.median(r["eval_tok_s"] or 0.0 for r in row["runs"])
    rates = []
    for _ in range(3):
        m.reset()
        t = time.perf_counter()
        m.eval(ids[:args.prefill])
        rates.append(args.prefill / (time.perf_counter() - t))
    row["prefill_tok_s"] = rates
    print(json.dumps(row, indent=1))
    print(f"llama.cpp {Path(args.gguf).name} split={args.split}: decode wall "
          f"{[round(r['wall_tok_s'], 1) for r in row['runs']]} median {row['wall_tok_s']:.1f} "
          f"tok/s (eval counters {row['eval_tok_s']:.1f}); prefill {args.prefill}: "
          f"{[round(r) for r in rates]} median {statistics.median(rates):.0f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
