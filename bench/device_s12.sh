#!/usr/bin/env bash
# One GPU (`nvidia-h200` / `nvidia-h100-x1`), calls of the device tool (2026-11-28, twelfth
# session): speculation's floors (issue 24) with the few-rows GEMV kernel. Carry .whl in every
# call, and one piece of the real default model's GGUF (.device-carry/smol.part00..02) in each of
# the first three calls of a machine, back to back: bench/device_s11.sh copies the pieces it is
# given to /tmp, where they stay while the machine is held.
#   call 1: `bash bench/device_s11.sh N` with part00 (the GPU tests of the last session's code)
#   R: with part01: the few-rows kernel's launch shapes against cuBLAS at 8, 16 and 32 rows on
#      the default model's shape (bench/gemv_sweep.py --rows).
#   G: with part02: greedy speculation on the unseen prompts, one stream, 2 shards, verify steps
#      through cuBLAS (LAYERSPLIT_GEMV_ROWS=1, the baseline) and through the few-rows kernel
#      (ROWS, default 32).
#   S: sampled speculation (temperature 0.7, top-p 0.9), the same two settings.
#   B: 8 streams, each speculating, against 8 plain streams, the same two settings.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
cp .device-carry/smol.part* /tmp/ 2>/dev/null
model() {
  [ -s /tmp/smol.part00 ] && [ -s /tmp/smol.part01 ] && [ -s /tmp/smol.part02 ] || {
    log "the model's pieces are not all parked in /tmp (three calls)"; exit 1; }
  mkdir -p "$LAYERSPLIT_HOME/models"
  [ -s "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] ||
    cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
      > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
}
spec="python3 bench/speculative.py --model default --devices cuda:0,cuda:0 --drafts default \
  --sets unseen"
ROWS=${ROWS:-32}
case "${1:-G}" in
R)
  for r in 8 16 32; do
    TAIL=14 run "rows_$r" 150 python3 bench/gemv_sweep.py --model smollm2-135m-shape --rows $r \
      --json "$OUT/rows_$r.json"
  done
  ;;
G)
  model
  for r in 1 $ROWS; do
    TAIL=12 run "greedy_$r" 170 env LAYERSPLIT_GEMV_ROWS=$r $spec --new-tokens 256 --repeat 3 \
      --json "$OUT/greedy_$r.json"
  done
  ;;
S)
  model
  for r in 1 $ROWS; do
    TAIL=12 run "sampled_$r" 200 env LAYERSPLIT_GEMV_ROWS=$r $spec --new-tokens 128 --repeat 3 \
      --temperature 0.7 --top-p 0.9 --json "$OUT/sampled_$r.json"
  done
  ;;
B)
  model
  for r in 1 $ROWS; do
    TAIL=12 run "streams_$r" 200 env LAYERSPLIT_GEMV_ROWS=$r $spec --streams 8 --ignore-eos \
      --new-tokens 128 --repeat 3 --json "$OUT/streams_$r.json"
  done
  ;;
esac
log done
