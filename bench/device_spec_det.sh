#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), three back-to-back calls of the device tool; the
# default model's GGUF travels in three pieces (`split -b 33000000 -d -a 2
# SmolLM2-135M-Instruct.Q4_1.gguf .device-carry/smol.part`), each call parking its piece in /tmp
# (the machine keeps it while warm).
#   call X: bash bench/device_spec_det.sh X    carry .whl .device-carry/smol.part00
#           the deterministic-mode and speculative GPU tests
#   call Y: bash bench/device_spec_det.sh Y    carry .whl .device-carry/smol.part01
#           the hybrid model's start-up twice (the second finds fla-core's autotuning cached)
#   call Z: bash bench/device_spec_det.sh Z    carry .whl .device-carry/smol.part02
#           deterministic mode (issue 24): plain decoding in the default mode and in
#           deterministic mode, and speculation in deterministic mode with the bundled draft
#           (chains of 4 rows), on the 12 held-out prompts, 2 shards on the one GPU, 3 repeats
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
stage=${1:?stage X, Y or Z}
source bench/device_env.sh
mkdir -p $LAYERSPLIT_HOME/models
cp .device-carry/smol.part* /tmp/ 2>/dev/null
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
source bench/device_stages.sh
if [ "$stage" = X ]; then
  run tests 200 $tests tests/shards/test_executor_deterministic.py \
    tests/gpu/test_speculative_gpu.py
elif [ "$stage" = Y ]; then
  run hybrid_start 400 python3 bench/startup.py --model random:qwen3.5-27b --devices cuda:0 \
    --repeats 2 --new-tokens 16 --max-context 4096 --json "$OUT/hybrid_start.json"
  grep -h "captured\|ready in" /tmp/hybrid_start.full | cut -c1-200 | tail -8 | tee -a "$LOG"
elif [ "$stage" = Z ]; then
  [ -s "$gguf" ] || cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"
  ls -la "$gguf" | tee -a "$LOG"
  # (chains of 4 rows: in deterministic mode a verify step runs row by row, so a long tree
  # costs its rows in steps; equality with plain decoding is what is measured)
  TAIL=60 run spec_det 500 python3 bench/speculative.py --model default --devices cuda:0,cuda:0 \
    --drafts default --new-tokens 128 --repeat 3 --deterministic --sets eval --limit 12 \
    --trees 0 --block 4 --json "$OUT/spec_det.json"
fi
log done
