#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), one call of the device tool (2026-11-26, second
# session), carry .whl .whl-tf: prefill chunks after the first through flash attention's own
# lower-right causal form with GQA (`attend`): its GPU test; a 32K prompt on the Qwen3-8B shape
# in 2048-token chunks and in one piece (issue 21); the hybrid prefill of 8K and 32K tokens next
# to transformers' own Qwen3.5 (issue 20); a 131,072-token prompt on the Qwen3-8B shape, the
# first request's decode at 128K next to the floor of weights + KV (issue 22).
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
run tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf --tb=short \
  tests/gpu/test_attend.py
q8="--model random:qwen3-8b --layouts cuda:0 --prompt-len 512 --new-tokens 16 --repeats 1"
run chunk2048 70 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
  --prefill-chunk 2048 --json "$OUT/chunk2048.json"
run chunk32k 60 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
  --prefill-chunk 32768 --json "$OUT/chunk32k.json"
install_tf
run prefill 230 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py \
  --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
  --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 \
  --hf --json "$OUT/prefill.json"
run long 150 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
  --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
  --prefill-chunk 8192 --repeats 1 --floor --json "$OUT/long.json"
log done
