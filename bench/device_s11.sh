#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), calls of the device tool (2026-11-28, eleventh
# session): the one-row GEMV kernels (`shards/kernels/gemv.py`, issue 21). Carry .whl in every
# call.
#   A: the GEMV kernels' launch shapes against cuBLAS per projection and for a layer's chain
#      (bench/gemv_sweep.py), then the decode step in one process with them off and on, both
#      shapes (bench/profile_decode.py, LAYERSPLIT_GEMV_KERNELS=0/1).
#   S: A's sweep, wider (blocks of 1-8 rows, 1-8 warps, blocks of K up to 2048), then the
#      pipelining depth (num_stages 1-4) of the projections cuBLAS still led.
#   T: carry .whl .device-carry/lcp.tgz .device-carry/smol_vocab.json.gz: llama.cpp built in the
#      background while the GPU tests run (the GEMV kernels', the decode kernels', and the
#      tenth session's stage N); then waits for the build.
#   C: carry .whl .device-carry/smol_vocab.json.gz: cold start of `generate` on the default
#      model's file (a random-weight GGUF of its shape, Q4_1, its vocabulary) with its draft,
#      an empty LAYERSPLIT_HOME first (on the call's machine, fresh or not), then 3 warm runs.
#   D: (right after T, on the same machine; carry also .device-carry/head.tar) decode at batch
#      1 through the runtime, the GEMV kernels on, off, and the baseline (head.tar: `git
#      archive` of the commit before, run from /tmp/old), default shape on 1 and 2 shards and
#      Llama-8B on 1; llama.cpp on the same shapes' GGUFs.
#   N: (for the next session) carry .whl: the GPU tests of what changed after this session's
#      last GPU call: the GEMV kernels' exactness test in its exact-projection form, the few-rows
#      kernel's failure path, the sampling noise's kernel against the torch ops, sampled
#      speculation and lookahead equal to plain decoding with the counter-based noise, the
#      eager steps' row kernels warmed at start.
#   P: (for the next session) carry .whl and one piece of the real default model's GGUF
#      (.device-carry/smol.part00..02), one per call back to back: each call parks its piece in
#      /tmp (as bench/device_s9.sh P).
#   V: (for the next session, after the three pieces) greedy speculation on the held-out
#      prompts, one stream, 2 shards, verify steps through cuBLAS (LAYERSPLIT_GEMV_ROWS=1, the
#      default) and through the few-rows kernel (=32); then that kernel's launch shapes at 32
#      rows against cuBLAS on the default model's shape (bench/gemv_sweep.py --rows 32).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
cp .device-carry/smol.part* /tmp/ 2>/dev/null
export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
if [ -e .device-carry/head.tar ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xf .device-carry/head.tar -C /tmp/old
fi
old="env -C /tmp/old PYTHONPATH=/tmp/site:/tmp/old"
smol="bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 --new-tokens 256 \
  --max-context 2048 --repeats 3"
l8b="bench/decode.py --model random:llama-8b-shape --prompt-len 512 --new-tokens 256 \
  --max-context 4096 --repeats 3 --layouts cuda:0"
model() {
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
}
case "${1:-A}" in
N)
  run tests 560 $tests tests/gpu/test_gemv.py tests/gpu/test_noise.py \
    tests/gpu/test_speculative_gpu.py tests/gpu/test_decode_ahead_gpu.py \
    tests/gpu/test_prefill_kernels.py tests/gpu/test_decode_kernels.py
  ;;
P) ;;
V)
  [ -s /tmp/smol.part00 ] && [ -s /tmp/smol.part01 ] && [ -s /tmp/smol.part02 ] || {
    log "the model's pieces are not all parked in /tmp (stage P, three calls)"; exit 1; }
  model
  for r in 1 32; do  # (the baseline first)
    TAIL=12 run "spec_rows_$r" 150 env LAYERSPLIT_GEMV_ROWS=$r python3 bench/speculative.py \
      --model default --devices cuda:0,cuda:0 --drafts default --new-tokens 256 --repeat 3 \
      --sets unseen --json "$OUT/spec_rows_$r.json"
  done
  TAIL=14 run rows_32 150 python3 bench/gemv_sweep.py --model smollm2-135m-shape --rows 32 \
    --json "$OUT/rows_32.json"
  ;;
A)
  for m in smollm2-135m-shape llama-8b-shape; do
    for g in 0 1; do
      TAIL=2 run "prof_${m}_$g" 60 env LAYERSPLIT_GEMV_KERNELS=$g python3 \
        bench/profile_decode.py --model random:$m --kv 768
    done
  done
  TAIL=24 run sweep 300 python3 bench/gemv_sweep.py --model smollm2-135m-shape ${SWEEP:-} \
    --model llama-8b-shape --json "$OUT/sweep.json"
  ;;
S)
  TAIL=40 run sweep 300 python3 bench/gemv_sweep.py --model smollm2-135m-shape \
    --model llama-8b-shape --json "$OUT/sweep.json"
  TAIL=40 run sweep_stages 200 python3 bench/gemv_sweep.py --model llama-8b-shape \
    --model smollm2-135m-shape --block-n 1,2,4 --warps 1,2,4 --stages 1,2,3,4 \
    --ops qkv,gate_up,head --json "$OUT/sweep_stages.json"
  ;;
T)
  lcp_build
  run tests 420 $tests tests/gpu/test_gemv.py tests/gpu/test_decode_kernels.py \
    tests/gpu/test_prefill_kernels.py tests/gpu/test_batched_verify_gpu.py \
    tests/gpu/test_speculative_gpu.py tests/gpu/test_gpu_path.py tests/gpu/test_warm.py
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 5)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  ;;
D)
  for g in 1 0; do
    TAIL=6 run "smol_$g" 110 env LAYERSPLIT_GEMV_KERNELS=$g python3 $smol \
      --layouts cuda:0 cuda:0,cuda:0
  done
  TAIL=6 run smol_old 110 $old python3 $smol --layouts cuda:0 cuda:0,cuda:0
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -2'
  for g in 1 0; do
    TAIL=6 run "l8b_$g" 100 env LAYERSPLIT_GEMV_KERNELS=$g python3 $l8b --floor
  done
  run l8b_lcp 60 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -2'
  ;;
C)
  mkdir -p /tmp/home_rnd/models
  python3 bench/random_gguf.py --shape configs/models/smollm2-135m-shape \
    --vocab .device-carry/smol_vocab.json.gz --type q4_1 \
    /tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf > /tmp/rgguf.log 2>&1
  log "random default-model GGUF: $(tail -1 /tmp/rgguf.log)"
  rm -rf /tmp/home_cold
  for i in 0 1 2 3; do
    TAIL=3 run "cold_$i" 70 env LAYERSPLIT_HOME=/tmp/home_cold python3 bench/startup_trace.py \
      /usr/bin/time -f 'wall %e s' python3 -m layersplit.launch.cli -v generate \
      'The capital of France is' --model /tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --max-tokens 64 --ignore-eos --json --devices cuda:0
  done
  ;;
esac
log done
