#!/usr/bin/env bash
# MoE decode on the device: the expert kernels' GPU tests, then where a Qwen3-30B-A3B-shaped
# decode step's time goes with the grouped-GEMM experts (LAYERSPLIT_MOE_GEMV_TOKENS=0) and with
# the GEMV kernels (the default) in the same call, then bench/moe.py (1 vs 2 shards, streams).
# Wheels the image lacks travel in .whl (device README). Results under $OUT.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "=== moe kernel tests ($(date +%T))"
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_moe_kernels.py -p no:cacheprovider \
  -o addopts="" -rf 2>&1 | tail -15 | tee "$OUT/moe_tests.txt"
for gemv in 0 8; do
  echo "=== profile, LAYERSPLIT_MOE_GEMV_TOKENS=$gemv ($(date +%T))"
  LAYERSPLIT_MOE_GEMV_TOKENS=$gemv timeout 200 python3 bench/profile_decode.py \
    --model random:qwen3-30b-a3b --kv 256 --steps 30 2>&1 | tail -22 | tee "$OUT/profile_$gemv.txt"
done
if [ -n "${MOE_BENCH:-}" ]; then
  echo "=== moe bench ($(date +%T))"
  timeout "${MOE_S:-330}" python3 bench/moe.py --device cuda:0 --streams 8,32 \
    --json "$OUT/moe.json" 2>&1 | tail -25 | tee "$OUT/moe.txt"
fi
echo "=== done ($(date +%T))"
