#!/usr/bin/env bash
# Two GPUs (`nvidia-h100-x2` / `nvidia-h200-x2`), one call of the device tool (2026-11-26, second
# session), carry .whl .whl-tf:
#   the Qwen3.5-27B shape (hybrid) decode, captured + fused step, on 1 GPU and split over 2 GPUs
#   (cuda-ipc edge), next to its HBM floor (issue 20); prefill of 8K and 32K tokens next to
#   transformers' own Qwen3.5 in the same call (issue 20; `attend` since the last measurement);
#   the deterministic-mode and paged-KV GPU tests (issues 24, 22).
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
model=random:qwen3.5-27b
run tests 150 $tests tests/shards/test_executor_deterministic.py \
  tests/shards/test_paged_kv_cache.py
run hybrid_x2 240 python3 bench/decode.py --model $model --layouts cuda:0 cuda:0,cuda:1 \
  --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor \
  --json "$OUT/hybrid_x2.json"
install_tf
run prefill 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py --model $model \
  --layouts cuda:0 --prompt-len 512 --new-tokens 16 --max-context 40960 --repeats 1 \
  --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 --hf --json "$OUT/prefill.json"
log done
