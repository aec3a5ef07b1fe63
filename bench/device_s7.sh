#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), back-to-back calls of the device tool
# (2026-11-27, seventh session). The code before this session's change travels as
# `git archive -o .device-carry/head.tar <commit> -- . ':!draft/weights'` (the baseline, run from
# /tmp/old in the same call). The default model's GGUF travels in three pieces of 30, 40 and
# 28.4 MB (`head -c`/`tail -c` into .device-carry/smol.part00..02: with the working tree, a
# call carries at most 64 MiB), each call parking its piece in /tmp.
#   A: carry .whl .device-carry/lcp.tgz .device-carry/smol_vocab.json.gz .device-carry/head.tar
#      .device-carry/smol.part00
#      A dense layer's decode step with nothing compiled (`shards.kernels.row_ops`): the default
#      model's shape on 1 and 2 shards, this code and the baseline, next to llama.cpp (built in
#      the background); cold start of `layersplit generate`, this code and the baseline, each
#      with empty caches once then three times warm (issue 21); the kernels' GPU tests.
#   B: carry .whl .device-carry/smol.part01 (on the machine A left warm)
#      The default model's shape again and the Llama-8B shape, this code and the baseline,
#      next to llama.cpp.
#   C: carry .whl .device-carry/smol.part02 (on the machine B left warm)
#      The real default model: cold start (generate), 8 streams each speculating against 8
#      plain (issue 24).
#   D: carry .whl .device-carry/smol_vocab.json.gz .device-carry/head.tar (a fresh machine)
#      Cold start of `layersplit generate` on the default model's file as users run it, with
#      the bundled draft (`draft = auto`): a random-weight GGUF of its shape, quantization and
#      vocabulary under the default model's file name, given as --model (start-up does not
#      depend on the weights' values; `auto` goes by the file's name). This code (draft
#      started ahead) and the baseline, and this code with --draft none.
#   E: carry .whl .device-carry/smol_vocab.json.gz: py-spy of one warm `generate` as in D, every
#      process's collapsed stacks (where the draft process spends its start).
#   F: carry .whl .device-carry/smol_vocab.json.gz: D's runs of this code again, after
#      `generate` ran the draft's step uncompiled (`draft_compile`); the GPU tests of the
#      captured draft step.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
export LCP="env PYTHONPATH=/tmp/lcpsite:/tmp/site python3 bench/llamacpp_decode.py"
REPO=$PWD
cp .device-carry/smol.part* /tmp/ 2>/dev/null
if [ -e .device-carry/head.tar ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xf .device-carry/head.tar -C /tmp/old
fi
old="env -C /tmp/old PYTHONPATH=/tmp/site:/tmp/old"  # (a command, for `run`)
# cold NAME DIR MODEL: `generate` from DIR with its own empty LAYERSPLIT_HOME, then 3 warm runs
cold() {
  local name=$1 dir=$2 model=$3 home=/tmp/home_$1 i
  rm -rf "$home"
  for i in 0 1 2 3; do
    TAIL=3 run "${name}_$i" 70 bash -c "cd $dir && LAYERSPLIT_HOME=$home PYTHONPATH=/tmp/site:$dir \
      python3 $REPO/bench/startup_trace.py /usr/bin/time -f 'wall %e s' python3 -m \
      layersplit.launch.cli -v generate --token-ids 5,6,7,8,9 --model $model --max-tokens 64 \
      --ignore-eos --json --devices cuda:0"
    cp "/tmp/${name}_$i.full" "$OUT/" 2>/dev/null
  done
}
smol="bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 --new-tokens 256 \
  --max-context 2048 --repeats 3 --layouts cuda:0 cuda:0,cuda:0"
l8b="bench/decode.py --model random:llama-8b-shape --prompt-len 512 --new-tokens 256 \
  --max-context 4096 --repeats 3 --layouts cuda:0 cuda:0,cuda:0"
case "${1:-A}" in
A)
  lcp_build
  TAIL=12 run smol_new 90 python3 $smol --json "$OUT/smol_new.json"
  TAIL=12 run smol_old 90 $old python3 $smol --json "$OUT/smol_old.json"
  cold new "$REPO" random:smollm2-135m-shape
  cold old /tmp/old random:smollm2-135m-shape
  run tests 150 $tests tests/gpu/test_row_ops.py tests/gpu/test_decode_kernels.py \
    tests/gpu/test_gpu_path.py
  while [ ! -e /tmp/lcp.done ] && ((SECONDS < deadline - 60)); do sleep 5; done
  log "llama.cpp: $(ls /tmp/lcp.done 2>/dev/null || echo 'not built'; tail -3 /tmp/lcp.log)"
  run smol_lcp 40 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/smol-q4_1.gguf --split none 2>&1 \
    | tail -1'
  ;;
B)
  TAIL=12 run smol_new 90 python3 $smol --json "$OUT/smol_new.json"
  TAIL=12 run smol_old 90 $old python3 $smol --json "$OUT/smol_old.json"
  TAIL=12 run l8b_new 120 python3 $l8b --floor --json "$OUT/l8b_new.json"
  TAIL=12 run l8b_old 120 $old python3 $l8b --json "$OUT/l8b_old.json"
  run l8b_lcp 50 bash -c 'CUDA_VISIBLE_DEVICES=0 $LCP /tmp/llama8b-f16.gguf --split none 2>&1 \
    | tail -1'
  ;;
C)
  mkdir -p /tmp/home_real/models
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > /tmp/home_real/models/SmolLM2-135M-Instruct.Q4_1.gguf
  log "default model: $(sha256sum /tmp/home_real/models/SmolLM2-135M-Instruct.Q4_1.gguf)"
  mkdir -p "$LAYERSPLIT_HOME/models" && cp /tmp/home_real/models/*.gguf "$LAYERSPLIT_HOME/models/"
  for i in 0 1 2; do
    TAIL=4 run "real_$i" 60 bash -c "LAYERSPLIT_HOME=/tmp/home_real python3 \
      bench/startup_trace.py /usr/bin/time -f 'wall %e s' python3 -m layersplit.launch.cli -v \
      generate 'The capital of France is' --max-tokens 64 --ignore-eos --json --devices cuda:0"
    cp "/tmp/real_$i.full" "$OUT/" 2>/dev/null
  done
  TAIL=40 run spec8 240 python3 bench/speculative.py --model default --devices cuda:0,cuda:0 \
    --drafts default --sets unseen --streams 8 --ignore-eos --new-tokens 128 --repeat 3 \
    --json "$OUT/spec8.json"
  ;;
D|F)
  mkdir -p /tmp/home_rnd/models
  python3 bench/random_gguf.py --shape configs/models/smollm2-135m-shape \
    --vocab .device-carry/smol_vocab.json.gz --type q4_1 \
    /tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf > /tmp/rgguf.log 2>&1
  log "random default-model GGUF: $(tail -1 /tmp/rgguf.log)"
  # realdef NAME DIR [ARGS...]: `generate` of the default model's file, its own empty home
  realdef() {
    local name=$1 dir=$2 home=/tmp/home_$1 i; shift 2
    rm -rf "$home"
    for i in 0 1 2 3; do
      TAIL=3 run "${name}_$i" 70 bash -c "cd $dir && LAYERSPLIT_HOME=$home \
        PYTHONPATH=/tmp/site:$dir python3 $REPO/bench/startup_trace.py /usr/bin/time \
        -f 'wall %e s' python3 -m layersplit.launch.cli -v generate 'The capital of France is' \
        --model /tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf --max-tokens 64 \
        --ignore-eos --json --devices cuda:0 $*"
      cp "/tmp/${name}_$i.full" "$OUT/" 2>/dev/null
    done
  }
  if [ "$1" = F ]; then  # after the draft's step went uncompiled under `generate`
    realdef fnew "$REPO"
    run tests 120 $tests tests/gpu/test_speculative_gpu.py -k "captured_step or split_runtime"
  else
    realdef dnew "$REPO"
    realdef dold /tmp/old
    realdef dnone "$REPO" --draft none
  fi
  ;;
esac
# E (see the top): caches warmed by one run first
if [ "${1:-}" = E ]; then
  gguf=/tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -e $gguf ] || { mkdir -p /tmp/home_rnd/models && python3 bench/random_gguf.py --shape \
    configs/models/smollm2-135m-shape --vocab .device-carry/smol_vocab.json.gz --type q4_1 \
    $gguf > /tmp/rgguf.log 2>&1; }
  gen="python3 -m layersplit.launch.cli generate 'The capital of France is' --model $gguf \
    --max-tokens 64 --ignore-eos --json --devices cuda:0"
  TAIL=2 run warm 90 bash -c "LAYERSPLIT_HOME=/tmp/home_e $gen"
  TAIL=3 run prof 120 bash -c "LAYERSPLIT_HOME=/tmp/home_e /tmp/site/bin/py-spy record \
    --subprocesses --format raw -r 250 -o $OUT/prof.txt -- $gen"
fi
