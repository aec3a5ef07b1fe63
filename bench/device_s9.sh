#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), back-to-back calls of the device tool on one warm
# machine (2026-11-27, ninth session): how 8 speculating streams share the chain (issue 24).
# The real default model's GGUF travels in three pieces (.device-carry/smol.part00..02), one per
# call, each call parking its piece in /tmp; `P` only parks it.
#   P: carry .whl and one piece.
#   H: (after the three pieces) 8 speculating streams against 8 plain, traced: with the default
#      micro-batches (one group per shard), then with every speculating stream in one group
#      (--spec-micro-batches 1); each trace's timeline, and the raw traces (gzipped) in $OUT.
#   T: (a fresh machine, after the three pieces again) the 8 streams with token trees of 31
#      (the draft's own), 7 and 0 (chains of 8 rows) draft tokens: what a verify step of
#      several sequences should carry.
#   S: (a fresh machine, after the three pieces again) one stream, sampled at temperature 0.7,
#      top-p 0.9 (the default `spec_sampling`, coupled), against plain sampling: issue 24's
#      sampled floor.
#   K: (not run yet: for the next session, after the three pieces) 8 streams, one repeat,
#      every shard and the draft profiled for steps 301-400 (`LAYERSPLIT_KERNEL_PROFILE`):
#      whether a verify round's ~9 ms is the shared GPU's or the hosts' (bench/kernel_summary.py).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
cp .device-carry/smol.part* /tmp/ 2>/dev/null
spec8="bench/speculative.py --model default --devices cuda:0,cuda:0 --drafts default \
  --sets unseen --streams 8 --ignore-eos --new-tokens 128 --repeat 3"
model() {
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
}
traced() {  # NAME EST ARGS...: the 8 streams traced, then their timeline and the raw trace
  local name=$1 est=$2; shift 2
  rm -rf "/tmp/trace_$name"
  TAIL=12 run "$name" "$est" env LAYERSPLIT_STEP_TRACE="/tmp/trace_$name" python3 $spec8 "$@" \
    --json "$OUT/$name.json"
  TAIL=70 run "timeline_$name" 40 python3 bench/step_timeline.py "/tmp/trace_$name" \
    --json "$OUT/timeline_$name.json"
  tar czf "$OUT/trace_$name.tgz" -C /tmp "trace_$name"
}
case "${1:-P}" in
P) ;;
H)
  model
  traced spec8 200
  traced spec8_mb1 200 --spec-micro-batches 1
  ;;
T)
  model
  TAIL=20 run trees 400 python3 $spec8 --trees 31,7,0 --json "$OUT/trees.json"
  ;;
K)
  model
  rm -rf /tmp/kprof
  TAIL=12 run kprof 200 env LAYERSPLIT_KERNEL_PROFILE=/tmp/kprof:300:100 python3 \
    ${spec8/--repeat 3/--repeat 1} --json "$OUT/kprof.json"
  TAIL=120 run kernels 60 python3 bench/kernel_summary.py /tmp/kprof --json "$OUT/kernels.json"
  tar czf "$OUT/kprof.tgz" -C /tmp kprof
  ;;
S)
  model
  TAIL=30 run sampled 100 python3 bench/speculative.py --model default --devices cuda:0,cuda:0 \
    --drafts default --sets unseen --new-tokens 128 --repeat 3 --temperature 0.7 --top-p 0.9 \
    --json "$OUT/sampled.json"
  ;;
esac
log done
