#!/usr/bin/env bash
# Structured output's cost on the device (`nvidia-h100-x1` or `nvidia-h200`), in calls of the
# device tool: decode tok/s of the default model with a JSON schema against free text, 1 shard
# (cuda:0) and 2 shards on the one GPU (cuda:0,cuda:0); floor: schema >= 0.9 x free text.
# Wheels the image lacks (llguidance) travel in .whl (device README). The default model's GGUF
# (98 MB) is too large for one call to carry: it travels in pieces, as for bench/device_spec.sh
# (`split -b 33000000 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf .device-carry/smol.part`:
# part00..02); each call parks the pieces it carries in /tmp (kept while the machine stays
# warm), and the bench runs once all PARTS are there.
#   call 1: bash bench/device_structured.sh     (carry .whl .device-carry/smol.part00)
#   call 2: bash bench/device_structured.sh     (carry .whl .device-carry/smol.part01)
#   call 3: bash bench/device_structured.sh     (carry .whl .device-carry/smol.part02)
# Results: $OUT/structured.json and .txt (the table: ratio, the coordinator's mask ms, the last
# shard's apply ms, their share of a free-text token's time).
set -uo pipefail
source bench/device_env.sh
mkdir -p $LAYERSPLIT_HOME/models
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
log() { echo "=== $* ($(date +%T))"; }
cp .device-carry/smol.part* /tmp/ 2>/dev/null
parts=${PARTS:-3}
if [ ! -s "$gguf" ]; then
  have=$(ls /tmp/smol.part* 2>/dev/null | wc -l)
  if [ "$have" -lt "$parts" ]; then
    log "parked $have of $parts pieces of the model; carry the next one"; ls -la /tmp/smol.part*
    exit 0
  fi
  cat $(ls /tmp/smol.part* | sort) > "$gguf"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
log structured output, default model on ${LAYOUTS:-cuda:0 cuda:0,cuda:0}
timeout "${BENCH_S:-540}" python3 bench/structured_output.py --model default \
  --layouts ${LAYOUTS:-cuda:0 cuda:0,cuda:0} --new-tokens "${NEW:-256}" \
  --repeats "${REPEATS:-3}" --json "$OUT/structured.json" 2>&1 \
  | grep -v "INFO shards\|INFO layersplit" | tee "$OUT/structured.txt" | tail -30
log done
