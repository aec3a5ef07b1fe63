#!/usr/bin/env bash
# Speculative decoding on the device, in three calls of the device tool (the default model's GGUF
# travels in pieces: .device-carry/smol.part00, part01, part02 made by
# `split -b 49000000 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf .device-carry/smol.part`).
#   stage T: GPU tests                               (carry .whl .device-carry/smol.part00)
#   stage D: train the bundled DFlash draft + a classic draft, then they wait in /tmp/drafts
#                                                    (carry .whl .device-carry/smol.part01
#                                                     .device-carry/smol.part02)
#   stage S: plain vs speculative decoding, same split, same run   (carry .whl)
set -uo pipefail
stage=${1:?stage T, D or S}
devices=${2:-cuda:0,cuda:0}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LAYERSPLIT_HOME=/tmp/lshome
mkdir -p $LAYERSPLIT_HOME/models /tmp/drafts
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
log() { echo "=== $* ($(date +%T))"; }
if [ "$stage" = T ]; then
  cp .device-carry/smol.part00 /tmp/smol.part00
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" -x 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.txt"
elif [ "$stage" = D ]; then
  cat /tmp/smol.part00 .device-carry/smol.part01 .device-carry/smol.part02 > "$gguf"
  log train
  python3 -m draft.train --target default --out /tmp/drafts/smollm2-135m-dflash --device cuda:0 \
    --seconds "${TRAIN_S:-220}" --gen-batch 512 --classic-out /tmp/drafts/smollm2-135m-classic4 \
    --classic-seconds "${CLASSIC_S:-75}" --report "$OUT/train_report.json" 2>&1 \
    | grep -v Warning | tee "$OUT/train_log.txt" | tail -25
  (cd /tmp/drafts/smollm2-135m-dflash && cp config.json "$OUT/draft_config.json" && \
    split -b 8000000 -d -a 1 model.safetensors "$OUT/draft_model.part")
elif [ "$stage" = S ]; then
  log speculative decoding, default model on "$devices"
  python3 bench/speculative.py --model default --devices "$devices" \
    --drafts /tmp/drafts/smollm2-135m-dflash,/tmp/drafts/smollm2-135m-classic4 \
    --new-tokens 256 --json "$OUT/spec.json" 2>&1 | tail -8 | tee "$OUT/spec.txt"
fi
log done
