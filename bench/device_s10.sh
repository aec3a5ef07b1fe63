#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool on one warm machine
# (2026-11-28, tenth session). Carry .whl in every call.
#   A: where a 3,900-token prefill's time goes on the default model's shape and the Llama-8B
#      shape (issue 21: prefill >= llama.cpp's at 3.9K): in one process, chunks of 2048 and one
#      piece, wall against the GPU's busy time and the kernel table (bench/profile_prefill.py).
#   B: carry .whl .device-carry/lcp.tgz .device-carry/smol_vocab.json.gz .device-carry/head.tar:
#      llama.cpp built in the background, while the GPU tests of the eager steps through the row
#      kernels (and of the decode kernels) run; then waits for the build.
#   C: (right after B, on the same machine, nothing else running) A's in-process profile of
#      this code and of the baseline (head.tar: `git archive` of the commit before, 9964e61,
#      without draft/weights and RESULTS.md, run from /tmp/old); through the runtime, 1 shard,
#      the 3,900-token prefill of both, then one more run of this code with its steps traced
#      (bench/step_timeline.py); llama.cpp's prefill and decode of the same shapes' GGUFs.
#   E: carry .whl .device-carry/head.tar: the runtime's TTFT of 512 and 3,900-token prompts on
#      the default model's shape, this code and the baseline, twice each, interleaved.
#   N: (for the next session) carry .whl: the GPU tests of what this session changed after its
#      last GPU call: the bf16 decode-kernel test's whole-run form, the prefill kernel's warm-up
#      at start, kept rows moved for all of a step's sequences at once (batched verify steps,
#      speculation), and the GPU path end to end.
#   D: carry .whl: where the row kernels pay in an eager step: the host's cost of each call,
#      and chunks of 256-2048 rows with the kernels off and on, both shapes, in one process.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
REPO=$PWD
export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
if [ -e .device-carry/head.tar ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xf .device-carry/head.tar -C /tmp/old
fi
old="env -C /tmp/old PYTHONPATH=/tmp/site:/tmp/old"  # (a command, for `run`)
pre="bench/decode.py --layouts cuda:0 --prompt-len 512 --new-tokens 16 --max-context 8192 \
  --repeats 3 --prefill 3900 --prefill-chunk 2048"
prof="bench/profile_prefill.py --tokens 3900 --chunks 2048,3900"
case "${1:-A}" in
A)
  TAIL=60 run prof_smol 120 python3 bench/profile_prefill.py --model random:smollm2-135m-shape \
    --tokens 3900 --chunks 2048,3900
  TAIL=60 run prof_8b 150 python3 bench/profile_prefill.py --model random:llama-8b-shape \
    --tokens 3900 --chunks 2048,3900
  ;;
B)
  lcp_build
  run tests 300 $tests tests/gpu/test_prefill_kernels.py tests/gpu/test_row_ops.py \
    tests/gpu/test_decode_kernels.py tests/gpu/test_gpu_path.py
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 5)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  ;;
C)
  for m in smollm2-135m-shape llama-8b-shape; do
    TAIL=4 run "prof_new_$m" 40 python3 $prof --model random:$m
    TAIL=4 run "prof_old_$m" 40 $old python3 $prof --model random:$m
  done
  for m in smollm2-135m-shape llama-8b-shape; do
    TAIL=8 run "pre_new_$m" 80 python3 $pre --model random:$m --json "$OUT/pre_new_$m.json"
    TAIL=8 run "pre_old_$m" 80 $old python3 $pre --model random:$m \
      --json "$OUT/pre_old_$m.json"
  done
  rm -rf /tmp/trace_smol
  TAIL=4 run pre_trace 40 env LAYERSPLIT_STEP_TRACE=/tmp/trace_smol python3 \
    ${pre/--repeats 3/--repeats 1} --model random:smollm2-135m-shape
  TAIL=60 run timeline 30 python3 bench/step_timeline.py /tmp/trace_smol
  tar czf "$OUT/trace_smol.tgz" -C /tmp trace_smol
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -2'
  run l8b_lcp 60 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -2'
  ;;
N)
  run tests 560 $tests tests/gpu/test_decode_kernels.py tests/gpu/test_prefill_kernels.py \
    tests/gpu/test_batched_verify_gpu.py tests/gpu/test_speculative_gpu.py \
    tests/gpu/test_gpu_path.py
  ;;
E)
  for i in 1 2; do
    TAIL=3 run "ttft_new_$i" 60 python3 ${pre/--prefill 3900/--prefill 512,3900} \
      --model random:smollm2-135m-shape
    TAIL=3 run "ttft_old_$i" 60 $old python3 ${pre/--prefill 3900/--prefill 512,3900} \
      --model random:smollm2-135m-shape
  done
  ;;
D)
  for m in smollm2-135m-shape llama-8b-shape; do
    TAIL=20 run "cross_$m" 120 python3 bench/profile_prefill.py --model random:$m --tokens 4096 \
      --chunks 256,512,1024,2048 --prefill-kernels off,on --launch-costs --no-profile
  done
  ;;
esac
log done
