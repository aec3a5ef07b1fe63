#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool (2026-11-26, fifth
# session), carry .whl:
#   A: the host tier's GPU tests on the code after the last review (mmap buffers, error
#      clearing, the ordering test, never run on a GPU); the MoE at batch 1 next to its floor
#      and at 8 streams (issue 23); the mixed load, median of 3 (issue 22).
#   B: decode lookahead (the next step queued behind the current one, its token taken on the
#      device), on and off in the same call: the default model's shape (1 shard; 2 shards on
#      the one GPU, where it is off) and the Llama-8B shape, next to llama.cpp (built in the
#      background, as bench/device_x2.sh does; carry .device-carry/lcp.tgz and
#      .device-carry/smol_vocab.json.gz too) on random-weight GGUFs of the same shapes.
#   C: its GPU tests; the default model's shape again, quiet, next to llama.cpp (call 2's
#      build, on the machine left warm); the MoE, on and off (issues 21, 23).
#   E: after the review fixes: the default model's shape and the MoE on and off again; the GPU
#      tests of the paths lookahead touches (speculation, capture at start, token masks).
#   F: cold start (issue 21): where the imports' time goes, `bench/startup.py` as `layersplit
#      generate` runs (one KV slot), and the command itself timed twice (the second finds the
#      compile caches the first filled).
#   G: prefill of 3,900 tokens (issue 21), ours (chunks of 2048, the GPU default) next to
#      llama.cpp's, built in the background as in B (same carry as B).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
case "${1:-A}" in
A)
  run tests 120 $tests tests/shards/test_paged_kv_cache.py
  TAIL=40 run moe 200 python3 bench/moe.py --layouts cuda:0 --streams 8 --repeats 3 \
    --json "$OUT/moe.json"
  TAIL=40 run mixed 330 python3 bench/concurrency.py --model random:qwen3-8b --layouts cuda:0 \
    --mixed 65536x1,2048x15 --prompt-len 2048 --new-tokens 128 --kv-cache-gb 24 \
    --prefill-chunk 2048 --repeats 3 --json "$OUT/mixed.json"
  ;;
B)
  lcp_build
  smol="python3 bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --repeats 3"
  l8b="python3 bench/decode.py --model random:llama-8b-shape --prompt-len 512 \
    --new-tokens 256 --max-context 4096 --repeats 3 --layouts cuda:0"
  TAIL=12 run smol_on 70 $smol --layouts cuda:0 cuda:0,cuda:0 --json "$OUT/smol_on.json"
  TAIL=12 run smol_off 50 $smol --layouts cuda:0 --decode-ahead off --json "$OUT/smol_off.json"
  TAIL=12 run l8b_on 90 $l8b --floor --json "$OUT/l8b_on.json"
  TAIL=12 run l8b_off 80 $l8b --decode-ahead off --json "$OUT/l8b_off.json"
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 90)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
  run smol_lcp 30 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -2'
  run l8b_lcp 50 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -2'
  ;;
C)
  run tests 200 $tests tests/gpu/test_decode_ahead_gpu.py tests/gpu/test_gpu_path.py
  smol="python3 bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --repeats 3 --layouts cuda:0"
  TAIL=8 run smol_on2 50 $smol --json "$OUT/smol_on2.json"
  TAIL=8 run smol_off2 40 $smol --decode-ahead off --json "$OUT/smol_off2.json"
  export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
  [ -e /tmp/smol-q4_1.gguf ] && run smol_lcp2 30 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP \
    /tmp/smol-q4_1.gguf --split none 2>&1 | tail -1'
  TAIL=8 run moe_on 120 python3 bench/moe.py --layouts cuda:0 --streams 8 --repeats 3 \
    --json "$OUT/moe_on.json"
  TAIL=8 run moe_off 120 python3 bench/moe.py --layouts cuda:0 --streams 8 --repeats 3 \
    --decode-ahead off --json "$OUT/moe_off.json"
  ;;
E)
  smol="python3 bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --repeats 3 --layouts cuda:0"
  TAIL=8 run smol_on 50 $smol --json "$OUT/smol_on.json"
  TAIL=8 run smol_off 40 $smol --decode-ahead off --json "$OUT/smol_off.json"
  TAIL=8 run moe_on 100 python3 bench/moe.py --layouts cuda:0 --streams 8 --repeats 3 \
    --json "$OUT/moe_on.json"
  run tests 330 $tests tests/gpu/test_decode_ahead_gpu.py tests/gpu/test_token_mask.py \
    tests/gpu/test_warm.py tests/gpu/test_speculative_gpu.py
  ;;
F)
  for m in layersplit.runtime.coordinator layersplit.shards.worker; do
    python3 -X importtime -c "import $m" 2> "$OUT/importtime_$m.txt"
    log "import $m: $(sort -t'|' -k2 -n "$OUT/importtime_$m.txt" | tail -1)"
  done
  gen="python3 -m layersplit.launch.cli generate --token-ids 5,6,7,8,9 --model \
    random:smollm2-135m-shape --devices cuda:0 --max-tokens 64 --ignore-eos --json"
  for i in 1 2 3; do
    run "cli_$i" 90 bash -c "/usr/bin/time -f 'command wall %e s' $gen 2>&1 | tail -2"
  done
  TAIL=14 run startup 200 python3 bench/startup.py --model random:smollm2-135m-shape \
    --devices cuda:0 --repeats 3 --new-tokens 128 --max-context 4096 --max-seqs 1 \
    --json "$OUT/startup.json"
  ;;
G)
  lcp_build
  for m in smollm2-135m-shape llama-8b-shape; do
    TAIL=12 run "prefill_$m" 100 python3 bench/decode.py --model random:$m --layouts cuda:0 \
      --prompt-len 512 --new-tokens 16 --max-context 8192 --repeats 1 --prefill 3900 \
      --prefill-chunk 2048 --json "$OUT/prefill_$m.json"
  done
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 60)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -2 /tmp/lcp.log)"
  export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
  run lcp 50 bash -c 'for g in smol-q4_1 llama8b-f16; do CUDA_VISIBLE_DEVICES=0 $LCP \
    /tmp/$g.gguf --split none 2>&1 | tail -1; done'
  ;;
esac
