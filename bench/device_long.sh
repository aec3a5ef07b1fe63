#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool (2026-11-26, third
# session), carry .whl (.whl-tf too for H): the decode-attention kernel's new launch (2
# programs per SM, 128-key blocks) and prefill chunks through cuDNN's attention split at the
# prefix (issues 20, 21, 22).
#   A: their GPU tests; the kernel's launch at verify shapes (rows 4, 8, 16); each backend of a
#      chunk's attention by prefix length;
#   M: the kernel's tiles at verify shapes (8 and 16 rows);
#   C: the merge kernel's tests, chunking at 32K again, the mixed load: 1 x 64K + 15 x 2K
#      prompts decoding together next to 16 x 2K (issue 22);
#   D: after the key split's cap: the kernel tests, the mixed load, the 128K run as 3 runs;
#   H: the hybrid prefill next to transformers (issue 20);
#   F: after the review: the GPU tests; the default model's shape by block size;
#   B: a 131,072-token prompt on the Qwen3-8B shape: TTFT and the first request's decode next
#      to the weights + KV floor (issue 22); a 32K prompt in 2048-token chunks and in one piece
#      (issue 21).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
case "${1:-A}" in
A)
  run tests 200 $tests tests/gpu/test_attend.py tests/gpu/test_decode_kernels.py \
    tests/gpu/test_warm.py tests/shards/test_executor_deterministic.py
  for r in 4 8 16; do
    TAIL=12 run "verify$r" 60 python3 bench/decode_attention_sweep.py --keys 2048,32768 \
      --rows $r --per-sm 2 --block-n 64,128,auto --warps 4 --stages default
  done
  TAIL=20 run prefill_attn 60 python3 bench/prefill_attention.py
  ;;
M)  # the kernel's tiles at verify shapes: query rows per tile, keys per block, warps
  for r in 8 16; do
    TAIL=30 run "tiles$r" 120 python3 bench/decode_attention_sweep.py --keys 2048,32768 \
      --rows $r --per-sm 2 --max-block-m 16,32,64 --block-n 64,128 --warps 4,8 \
      --stages default
  done
  ;;
B)
  run long 200 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
    --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
    --prefill-chunk 8192 --repeats 1 --floor --json "$OUT/long.json"
  q8="--model random:qwen3-8b --layouts cuda:0 --prompt-len 512 --new-tokens 16 --repeats 1"
  run chunk2048 90 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 2048 --json "$OUT/chunk2048.json"
  run chunk32k 70 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 32768 --json "$OUT/chunk32k.json"
  ;;
C)  # the merge kernel's tests; chunking at 32K again (issue 21); the mixed load (issue 22)
  run tests 120 $tests tests/gpu/test_attend.py
  q8="--model random:qwen3-8b --layouts cuda:0 --prompt-len 512 --new-tokens 16 --repeats 1"
  run chunk2048 90 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 2048 --json "$OUT/chunk2048.json"
  run chunk32k 70 python3 bench/decode.py $q8 --max-context 33792 --prefill 32768 \
    --prefill-chunk 32768 --json "$OUT/chunk32k.json"
  TAIL=12 run mixed 240 python3 bench/concurrency.py --model random:qwen3-8b --layouts cuda:0 \
    --mixed 65536x1,2048x15 --prompt-len 2048 --new-tokens 128 --kv-cache-gb 24 \
    --prefill-chunk 8192 --json "$OUT/mixed.json"
  ;;
D)  # the key split's cap: the kernel tests, the mixed load again, the 128K run as 3 runs
  run tests 120 $tests tests/gpu/test_decode_kernels.py
  TAIL=12 run mixed 200 python3 bench/concurrency.py --model random:qwen3-8b --layouts cuda:0 \
    --mixed 65536x1,2048x15 --prompt-len 2048 --new-tokens 128 --kv-cache-gb 24 \
    --prefill-chunk 8192 --json "$OUT/mixed.json"
  run long 260 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
    --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
    --prefill-chunk 8192 --repeats 3 --floor --json "$OUT/long.json"
  ;;
H)  # the hybrid prefill next to transformers' Qwen3.5 (issue 20): chunks after the first
  # through cuDNN where it takes head dim 256 (logged by the shard when it does not)
  install_tf
  run prefill 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py \
    --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
    --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 \
    --hf --json "$OUT/prefill.json"
  grep -h "cuDNN attention failed" /tmp/prefill.full | head -3 | tee -a "$LOG"
  ;;
F)  # after the review: the GPU tests of the kernel (run-time split count) and of the cuDNN
  # split; the default model's shape with 64- and 128-key blocks at short contexts
  run tests 200 $tests tests/gpu/test_decode_kernels.py
  TAIL=14 run sweepsmol 80 python3 bench/decode_attention_sweep.py --shapes smollm2-135m \
    --keys 512,4096 --per-sm 1,2 --block-n 64,128 --warps 4 --stages default
  TAIL=8 run sweep8b 80 python3 bench/decode_attention_sweep.py --keys 32768,131072 \
    --per-sm 1,2 --block-n 64,128 --warps 4 --stages default
  ;;
esac
log done
