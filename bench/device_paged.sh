#!/usr/bin/env bash
# GPU checks of issue 22 (paged KV) on one GPU, in one call of the device tool, from the
# repository root with the pyzmq wheel in .whl/:
#   bash bench/device_paged.sh [STAGES]      STAGES: comma-separated, default all:
#   paged     python3 -m pytest -m gpu tests/shards/test_paged_gpu.py (the decode kernel over
#             block tables vs gather + the torch path; graphs over a paged pool replayed at
#             several lengths and slots)
#   gputests  tests/gpu (the decode path, graphs, batched steps, speculation, the runtime on
#             CUDA: every shard's KV is the paged pool now)
#   decode    bench/decode.py, default model's shape, 1 GPU: decode tok/s over the paged pool
#             (compare with bench/RESULTS.md's contiguous numbers)
# Everything stops starting new stages after DEADLINE seconds (default 480). Logs: $OUT/log.txt.
set -uo pipefail
source bench/device_env.sh
stages=${1:-paged,gputests,decode}
deadline=${DEADLINE:-480}
LOG=$OUT/log.txt
log() { echo "=== $* (t=${SECONDS}s)" | tee -a "$LOG"; }
want() { [[ ",$stages," == *",$1,"* ]] && { ((SECONDS < deadline)) || { log "skip $1: deadline"; false; }; }; }
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee -a "$LOG"
if want paged; then
  log "paged kernel and graph tests"
  timeout 300 python3 -m pytest -q -m gpu tests/shards/test_paged_gpu.py -p no:cacheprovider \
    -o addopts="" 2>&1 | tail -25 | tee -a "$LOG"
fi
if want gputests; then
  log "GPU tests"
  timeout 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 \
    | tail -30 | tee -a "$LOG"
fi
if want decode; then
  log "decode bench (paged pool), 1 GPU"
  timeout 240 python3 bench/decode.py --layouts cuda:0 --prompt-len 2048 --new-tokens 128 \
    --max-context 4096 --json "$OUT/decode.json" 2>&1 | tail -15 | tee -a "$LOG"
fi
log "done"
