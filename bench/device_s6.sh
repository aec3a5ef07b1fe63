#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool (2026-11-27, sixth
# session), carry .whl .device-carry/lcp.tgz .device-carry/smol_vocab.json.gz:
#   A: decode lookahead on a split runtime (the token board, `ipc.token_board`): its GPU tests;
#      the default model's shape and the Llama-8B shape on 1 shard and 2 shards on the one GPU,
#      lookahead on and off in the same call, next to llama.cpp (built in the background, as
#      bench/device_s5.sh B) on random-weight GGUFs of the same shapes (issue 21).
#   B: the GPU tests after the fix of call 1 (the reader viewed the board's bytes, not its
#      int64 tokens), with llama.cpp built in the background for C.
#   C: on the machine B left warm (llama.cpp built, quiet): the decode runs of A and llama.cpp.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
case "${1:-A}" in
A)
  lcp_build
  run tests 150 $tests tests/gpu/test_decode_ahead_gpu.py tests/ipc/test_token_board.py
  smol="python3 bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --repeats 3 --layouts cuda:0 cuda:0,cuda:0"
  l8b="python3 bench/decode.py --model random:llama-8b-shape --prompt-len 512 \
    --new-tokens 256 --max-context 4096 --repeats 3 --layouts cuda:0,cuda:0"
  TAIL=12 run smol_on 90 $smol --json "$OUT/smol_on.json"
  TAIL=12 run smol_off 90 $smol --decode-ahead off --json "$OUT/smol_off.json"
  TAIL=12 run l8b_on 100 $l8b --floor --json "$OUT/l8b_on.json"
  TAIL=12 run l8b_off 90 $l8b --decode-ahead off --json "$OUT/l8b_off.json"
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 90)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -1'
  run l8b_lcp 50 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -1'
  ;;
B)
  lcp_build
  run tests 300 $tests tests/gpu/test_decode_ahead_gpu.py tests/ipc/test_token_board.py \
    tests/gpu/test_gpu_path.py
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 10)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  ;;
C)
  smol="python3 bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --repeats 3 --layouts cuda:0 cuda:0,cuda:0"
  l8b="python3 bench/decode.py --model random:llama-8b-shape --prompt-len 512 \
    --new-tokens 256 --max-context 4096 --repeats 3"
  TAIL=12 run smol_on 90 $smol --json "$OUT/smol_on.json"
  TAIL=12 run smol_off 90 $smol --decode-ahead off --json "$OUT/smol_off.json"
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -1'
  TAIL=12 run l8b_on 150 $l8b --layouts cuda:0 cuda:0,cuda:0 --floor --json "$OUT/l8b_on.json"
  TAIL=12 run l8b_off 90 $l8b --layouts cuda:0,cuda:0 --decode-ahead off \
    --json "$OUT/l8b_off.json"
  run l8b_lcp 50 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -1'
  ;;
esac
