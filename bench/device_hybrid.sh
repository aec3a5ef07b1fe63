#!/usr/bin/env bash
# One device call for the hybrid models' GPU path: the hybrid GPU tests (fla-core's gated delta
# rule against the torch path, a 2-shard CLI run on one GPU), then the decode and prefill speed
# of a Qwen3.5-27B-shape model (configs/models/qwen3.5-27b, seeded random weights, bf16) on one
# GPU, 1 shard vs 2 shards, next to its HBM floor (weights + recurrent states + KV per token).
# fla-core is not in the image: its wheel travels in .whl with the others (device README;
# `pip download fla-core==0.6.0 --no-deps -d .whl`; it needs einops and triton, both in the
# image). Results under $OUT.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import importlib.metadata as m, fla.ops.gated_delta_rule; print('fla-core', m.version('fla-core'))" \
  2>&1 | tee "$OUT/fla.txt"
grep -q '^fla-core' "$OUT/fla.txt" || { echo "fla-core does not import: carry its wheel"; exit 1; }
echo "=== hybrid gpu tests ($(date +%T))"
timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -m gpu tests/shards/test_hybrid_gpu.py \
  -p no:cacheprovider -o addopts="" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
echo "=== qwen3.5-27b shape: decode and prefill, 1 vs 2 shards on cuda:0 ($(date +%T))"
timeout "${BENCH_S:-480}" python3 bench/decode.py --model random:qwen3.5-27b \
  --layouts cuda:0 cuda:0,cuda:0 --prompt-len 512 --new-tokens "${NEW_TOKENS:-64}" \
  --prefill "${PREFILL:-8192,32768}" --prefill-chunk "${PREFILL_CHUNK:-2048}" \
  --max-context 33280 --floor --json "$OUT/qwen35_27b.json" 2>&1 | tail -25 \
  | tee "$OUT/qwen35_27b.txt"
echo "=== done ($(date +%T))"
