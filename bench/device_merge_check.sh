#!/usr/bin/env bash
# One device call after a session's merges: the GPU tests, then the MoE benchmark
# (Qwen3-30B-A3B shape, 1 vs 2 shards on the one GPU, 8 and 32 streams). Wheels the image lacks
# travel in .whl (device README). Results under $OUT.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "=== gpu tests ($(date +%T))"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -m gpu tests/gpu tests/shards/test_paged_gpu.py -p no:cacheprovider \
  -o addopts="" 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
echo "=== moe ($(date +%T))"
timeout "${MOE_S:-330}" python3 bench/moe.py --device cuda:0 --streams 8,32 \
  --json "$OUT/moe.json" 2>&1 | tail -25 | tee "$OUT/moe.txt"
echo "=== done ($(date +%T))"
