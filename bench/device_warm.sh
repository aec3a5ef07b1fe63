#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), two back-to-back calls of the device tool
# (2026-11-26, second session):
#   call A: bash bench/device_warm.sh A    carry .whl .whl-tf
#           GPU tests: the graphs captured at start (tests/gpu/test_warm.py), `attend`'s
#           lower-right flash form, the decode kernels (keys read up to the last row written),
#           deterministic mode, the GPU path; the hybrid prefill of 8K and 32K tokens next to
#           transformers' own Qwen3.5 (issue 20)
#   call B: bash bench/device_warm.sh B    carry .whl
#           start-up to the first token and the first answer's decode, capture_at_start on and
#           off (issue 21); a 32K prompt on the Qwen3-8B shape in 2048-token chunks and in one
#           piece (issue 21); a 131,072-token prompt, the first request's decode at 128K
#           (issue 22)
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
stage=${1:?stage A or B}
source bench/device_env.sh
source bench/device_stages.sh
if [ "$stage" = A ]; then
  run tests 260 $tests tests/gpu/test_warm.py tests/gpu/test_attend.py \
    tests/gpu/test_decode_kernels.py tests/shards/test_executor_deterministic.py \
    tests/gpu/test_gpu_path.py
  grep -v "DEBUG\|INFO\|torch.__trace" /tmp/tests.full | tail -150 > "$OUT/tests.txt"
  install_tf
  run prefill 280 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py \
    --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
    --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 \
    --hf --json "$OUT/prefill.json"
elif [ "$stage" = B ]; then
  smol="--model random:smollm2-135m-shape --devices cuda:0 --repeats 3 --new-tokens 128"
  run startup_on 120 python3 bench/startup.py $smol --max-context 4096 --json "$OUT/startup_on.json"
  run startup_off 100 python3 bench/startup.py $smol --max-context 4096 --capture-at-start off \
    --json "$OUT/startup_off.json"
  q8="--model random:qwen3-8b --layouts cuda:0 --prompt-len 512 --new-tokens 16 --repeats 1"
  run chunk2048 100 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 2048 --json "$OUT/chunk2048.json"
  run chunk32k 100 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 32768 --json "$OUT/chunk32k.json"
  run long 170 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
    --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
    --prefill-chunk 8192 --repeats 1 --floor --json "$OUT/long.json"
fi
log done
