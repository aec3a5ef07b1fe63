#!/usr/bin/env bash
# Continuous batching on the device (`nvidia-h200-x2`), in one call of the device tool
# (carry .whl): the GPU tests, then bench/concurrency.py on the 8B shape, 1 GPU vs 2 GPUs.
set -uo pipefail
source bench/device_env.sh
log() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
if [ -n "${GPU_TESTS:-tests/gpu}" ]; then
  log gpu tests
  python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" \
    -p no:logging 2>&1 | grep -v "^DEBUG" > "$OUT/gpu_tests.txt"; tail -40 "$OUT/gpu_tests.txt"
fi
[ "${BENCH:-1}" = 1 ] || exit 0
log concurrency
python3 bench/concurrency.py --model "${MODEL:-random:qwen3-8b}" --layouts ${LAYOUTS:-cuda:0 cuda:0,cuda:1} \
  --streams "${STREAMS:-1,2,4,8,16}" --prompt-len 128 --new-tokens 128 \
  --prefill-len "${PREFILL:-32768}" --prefill-chunk "${CHUNK:-2048}" \
  --json "$OUT/concurrency.json" 2>&1 | grep -v "INFO shards\|INFO layersplit" \
  | tee "$OUT/concurrency.txt" | tail -30
log done
