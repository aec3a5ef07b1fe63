#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool (2026-11-26, fourth
# session), carry .whl (.whl-tf too for A):
#   A: the decode-attention kernel's GPU tests (the run-time split count and the combine loop
#      over groups of 32, run only under Triton's interpreter before); the kernel on a shape of
#      4 KV heads at 8K-256K keys (more than 32 splits); the hybrid prefill in one process, ours
#      next to transformers', kernel tables side by side (issue 20).
#   B: after the prefill's causal conv moved to fla-core's kernel: its GPU tests and the bf16
#      reference of the kernel tests; the profile again; the end-to-end prefill next to
#      transformers at 8K and 32K.
#   C: the host tier's asynchronous swaps (page-locked buffers, a copy stream): its GPU test,
#      bench/kv_swap.py next to the synchronous pageable copy it replaced; the hybrid fused-step
#      tests not yet run on this code (bf16, Qwen3-Next and Qwen3.5-MoE).
#   D: prefix sharing in device memory: 8 requests on one 30K-token prefix (issue 22).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
case "${1:-A}" in
A)
  run tests 200 $tests tests/gpu/test_decode_kernels.py tests/gpu/test_attend.py
  TAIL=16 run sweep4 90 python3 bench/decode_attention_sweep.py --shapes qwen3-30b-a3b,qwen3-8b \
    --keys 8192,65536,262144 --per-sm 2 --block-n auto --warps 4 --stages default
  install_tf
  TAIL=90 run hybrid 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 \
    bench/profile_prefill.py --model random:qwen3.5-27b --tokens 8192 --chunks 8192 --hf
  ;;
B)
  install_tf
  TAIL=40 run hybrid 240 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 \
    bench/profile_prefill.py --model random:qwen3.5-27b --tokens 8192 --chunks 8192 --hf
  run prefill 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py \
    --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
    --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 \
    --hf --json "$OUT/prefill.json"
  # (a fresh machine compiles and autotunes every Triton kernel: these take minutes)
  run tests 150 $tests tests/gpu/test_decode_kernels.py -k "4500 or 900"
  run tests2 200 $tests tests/shards/test_hybrid_gpu.py -k "fused or prefill or carries"
  ;;
C)
  run tests 60 $tests tests/shards/test_paged_kv_cache.py
  run swap 120 python3 bench/kv_swap.py --tokens 8192,32768 --repeats 3
  run tests2 300 $tests tests/shards/test_hybrid_gpu.py -k "fused and bf16 and (next or moe)"
  ;;
D)
  run shared 400 python3 bench/shared_prefix.py --model random:qwen3-8b --devices cuda:0 \
    --prefix 30720 --requests 8 --kv-cache-gb 24
  ;;
esac
