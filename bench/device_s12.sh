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
#   T: (for the next session, after G) greedy speculation with smaller token trees (31, 15 and 7
#      draft tokens), now that a verify step's rows cost more than a plain step's.
#   F: (no model pieces; carry also .device-carry/head.tar, `git archive` of the commit before)
#      the GPU tests of the query tiles as programs of their own and of the LM head's few-rows
#      kernel at verify rows, then a round's parts in one process (bench/profile_draft.py, the
#      default model's shape with random weights), this code and the commit before, alternating.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
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
  default_model
  for r in $(printf '1\n%s\n' "$ROWS" | sort -un); do
    TAIL=12 run "greedy_$r" 170 env LAYERSPLIT_GEMV_ROWS=$r $spec --new-tokens 256 --repeat 3 \
      --json "$OUT/greedy_$r.json"
  done
  ;;
S)
  default_model
  for r in $(printf '1\n%s\n' "$ROWS" | sort -un); do
    TAIL=12 run "sampled_$r" 200 env LAYERSPLIT_GEMV_ROWS=$r $spec --new-tokens 128 --repeat 3 \
      --temperature 0.7 --top-p 0.9 --json "$OUT/sampled_$r.json"
  done
  ;;
T)
  default_model
  TAIL=16 run trees 300 $spec --new-tokens 256 --repeat 3 --trees 31,15,7 \
    --json "$OUT/trees.json"
  ;;
B)
  default_model
  for r in $(printf '1\n%s\n' "$ROWS" | sort -un); do
    TAIL=12 run "streams_$r" 200 env LAYERSPLIT_GEMV_ROWS=$r $spec --streams 8 --ignore-eos \
      --new-tokens 128 --repeat 3 --json "$OUT/streams_$r.json"
  done
  ;;
F)
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xf .device-carry/head.tar -C /tmp/old &&
    ln -s "$PWD/draft/weights" /tmp/old/draft/weights
  for i in 1 2 3; do
    TAIL=2 run "prof_new_$i" 30 python3 bench/profile_draft.py \
      --target random:smollm2-135m-shape --kv 400
    TAIL=2 run "prof_old_$i" 30 env -C /tmp/old PYTHONPATH=/tmp/site:/tmp/old python3 \
      bench/profile_draft.py --target random:smollm2-135m-shape --kv 400
  done
  run tests 100 $tests tests/gpu/test_decode_kernels.py tests/gpu/test_batched_verify_gpu.py \
    tests/gpu/test_gemv.py -k "tree or chain or kernel_decode or verify or head or few_rows"
  ;;
esac
log done
