#!/usr/bin/env bash
# Issue 27: the runs on two GPUs (`nvidia-h200-x2`), in two back-to-back calls of the device
# tool (the second finds what the first parked in /tmp: the machine keeps it while warm).
#   call 1: bash bench/device_x2.sh 1    carry .whl .device-carry/lcp.tgz .device-carry/smol_vocab.json.gz
#           llama.cpp (llama-cpp-python, CUDA) builds in the background, then writes random-weight
#           GGUFs of the default model's shape (Q4_1) and the Llama-8B shape (F16);
#           in front: Qwen3-8B shape 1 vs 2 GPUs; Qwen3.5-27B shape (hybrid) 1 vs 2 GPUs; the
#           Qwen3-30B-A3B shape (MoE) 1 vs 2 GPUs at batch 1 and 8 streams; a 32K prefix of the
#           hybrid saved by a 2-GPU run and restored into a 1-GPU run (same greedy tokens).
#   call 2: bash bench/device_x2.sh 2    (no carry beyond .whl)
#           the cuda-ipc hop (1 token, hidden 4096, 5 runs); the default model's shape and the
#           Llama-8B shape, ours 1 vs 2 GPUs next to llama.cpp's on one GPU and its layer split
#           on two; a 131,072-token prompt on the Qwen3-8B shape, 1 vs 2 GPUs (prefill, decode
#           at 128K), then saved on 2 GPUs and restored after a restart.
# Random weights everywhere (speed does not depend on them). A stage starts only if its
# estimate fits before DEADLINE seconds (default 590) and is cut there. Results: $OUT/log.txt (each stage's last lines)
# and the benches' JSON files.
# llama-cpp-python's source travels as .device-carry/lcp.tgz (shared/anchors/README.md says how
# to make it; its missing dependency, diskcache, is in .whl); the vocabulary for the GGUFs as
# .device-carry/smol_vocab.json.gz (`python bench/random_gguf.py --export-vocab GGUF OUT`).
set -uo pipefail
stage=${1:?stage 1 or 2}
source bench/device_env.sh
deadline=${DEADLINE:-590}
LOG=$OUT/log.txt
source bench/device_stages.sh
if [ "$stage" = 1 ]; then
  lcp_build
  run qwen3_8b 90 python3 bench/decode.py --model random:qwen3-8b \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 4096 \
    --repeats 3 --json "$OUT/qwen3_8b.json"
  run hybrid 120 python3 bench/decode.py --model random:qwen3.5-27b \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 128 --max-context 4096 \
    --repeats 3 --floor --json "$OUT/hybrid.json"
  run moe 150 python3 bench/moe.py --layouts cuda:0 cuda:0,cuda:1 --streams 8 --repeats 3 \
    --json "$OUT/moe.json"
  run hybrid_xsplit 120 python3 bench/prefix_cache.py --model random:qwen3.5-27b \
    --devices cuda:0,cuda:1 --restore-devices cuda:0 --lengths 32768 --prefill-chunk 2048 \
    --check-tokens 16 --dir /tmp/pc27 --json "$OUT/hybrid_xsplit.json"
  while [ ! -e /tmp/lcp.done ] && kill -0 "$(cat /tmp/lcp.pid)" 2>/dev/null \
    && ((SECONDS < deadline)); do sleep 5; done
  log "llama.cpp build: $(ls /tmp/lcp.done 2>/dev/null || echo 'not done')"
  tail -4 /tmp/lcp.log | tee -a "$LOG"
elif [ "$stage" = 2 ]; then
  run hop 40 bash -c 'for i in 1 2 3 4 5; do python3 bench/hop_latency.py \
    --devices cuda:0,cuda:1 --transports cuda-ipc --tokens 1 --hidden 4096 --iters 1000 \
    --json /tmp/hop_$i.json 2>&1 | tail -3; done'
  cat /tmp/hop_*.json > "$OUT/hop.json" 2>/dev/null
  run smol_ours 50 python3 bench/decode.py --model random:smollm2-135m-shape \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 2048 \
    --repeats 3 --json "$OUT/smol_ours.json"
  for i in $(seq 24); do [ -e /tmp/lcp.done ] && break; sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -2 /tmp/lcp.log)"
  export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -1; CUDA_VISIBLE_DEVICES=0,1 $LCP /tmp/smol-q4_1.gguf --split layer 2>&1 | tail -1'
  run llama8b_ours 80 python3 bench/decode.py --model random:llama-8b-shape \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 4096 \
    --repeats 3 --json "$OUT/llama8b_ours.json"
  run llama8b_lcp 80 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none \
    2>&1 | tail -1; CUDA_VISIBLE_DEVICES=0,1 $LCP /tmp/llama8b-f16.gguf --split layer 2>&1 \
    | tail -1'
  run long128k 120 python3 bench/decode.py --model random:qwen3-8b \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 131072 --new-tokens 64 --max-context 131200 \
    --kv-cache-gb 24 --prefill-chunk 8192 --repeats 1 --json "$OUT/long128k.json"
  run long128k_cache 110 python3 bench/prefix_cache.py --model random:qwen3-8b \
    --devices cuda:0,cuda:1 --lengths 131072 --prefill-chunk 8192 --kv-cache-gb 24 --dir /tmp/pc128 \
    --json "$OUT/long128k_cache.json"
fi
log done
