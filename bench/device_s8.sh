#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), back-to-back calls of the device tool on one warm
# machine (2026-11-27, eighth session): batched verify steps (issue 24). The baseline (commit
# dd6c51a) travels as `git archive -o .device-carry/head.tar dd6c51a -- . ':!draft/weights'`
# and runs from /tmp/old; the real default model's GGUF in three pieces (.device-carry/
# smol.part00..02, 30 / 40 / 28.4 MB: with the working tree a call carries at most 64 MiB),
# each call parking its piece in /tmp.
#   A: carry .whl .device-carry/head.tar .device-carry/smol.part00
#      GPU tests: batched verify steps against each alone (kernels and torch path), and with
#      ALL=1 through the executor and the split runtime, warmed graphs, the decode paths they
#      touch.
#   B: carry .whl .device-carry/smol.part01
#      The hybrid model's fla causal-conv GPU tests with fla-core 0.6 (the seventh session
#      carried 0.5.2, which lacks it).
#   C: carry .whl .device-carry/smol.part02
#      The real default model, 2 shards on the one GPU: 8 streams each speculating against 8
#      plain, this code and the baseline.
# After the draft's proposals were batched too (a fresh machine, the pieces again):
#   D: carry .whl .device-carry/smol.part00: the speculative and batched verify GPU tests.
#   E: carry .whl .device-carry/smol.part01: the warmed-graph and GPU-path tests.
#   F: carry .whl .device-carry/smol.part02: C's 8 streams again, and 4 streams, this code.
#   G: (not run yet) F's 8 streams with per-step traces, and their timeline.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
cp .device-carry/smol.part* /tmp/ 2>/dev/null
if [ -e .device-carry/head.tar ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xf .device-carry/head.tar -C /tmp/old &&
    ln -s "$PWD/draft/weights" /tmp/old/draft/weights  # (the bundled draft: unchanged)
fi
old="env -C /tmp/old PYTHONPATH=/tmp/site:/tmp/old"  # (a command, for `run`)
spec8="bench/speculative.py --model default --devices cuda:0,cuda:0 --drafts default \
  --sets unseen --streams 8 --ignore-eos --new-tokens 128 --repeat 3"
case "${1:-A}" in
A)
  if [ -n "${ALL:-}" ]; then  # (the first call: every test these changes touch)
    run tests 400 $tests tests/gpu/test_batched_verify_gpu.py tests/gpu/test_warm.py \
      tests/gpu/test_speculative_gpu.py tests/shards/test_paged_gpu.py \
      tests/gpu/test_decode_kernels.py tests/gpu/test_gpu_path.py
  else
    run tests 200 $tests tests/gpu/test_batched_verify_gpu.py
  fi
  ;;
B)
  run hybrid 150 $tests tests/shards/test_hybrid_gpu.py -k "fla_causal_conv"
  ;;
C)
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
  TAIL=40 run spec8_new 260 python3 $spec8 --json "$OUT/spec8_new.json"
  TAIL=40 run spec8_old 260 $old python3 $spec8 --json "$OUT/spec8_old.json"
  ;;
D)  # (a fresh machine: the pieces again; after the draft's proposals were batched)
  run tests 300 $tests tests/gpu/test_speculative_gpu.py tests/gpu/test_batched_verify_gpu.py
  ;;
E)
  run tests 200 $tests tests/gpu/test_warm.py tests/gpu/test_gpu_path.py
  ;;
F)
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
  TAIL=40 run spec8_new 260 python3 $spec8 --json "$OUT/spec8_new.json"
  TAIL=40 run spec4_new 200 python3 ${spec8/--streams 8/--streams 4} --json "$OUT/spec4_new.json"
  ;;
G)  # (written for the next session, not run in this one: after C's or F's pieces are here)
  # where a speculating step's 8-10 ms go across the processes (`ipc/step_trace.py`)
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -rf /tmp/trace
  TAIL=10 run spec8_trace 200 env LAYERSPLIT_STEP_TRACE=/tmp/trace python3 $spec8 \
    --json "$OUT/spec8_trace.json"
  TAIL=60 run timeline 30 python3 bench/step_timeline.py /tmp/trace --json "$OUT/timeline.json"
  ;;
esac
log done
