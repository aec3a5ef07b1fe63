#!/usr/bin/env bash
# Speculative decoding on the device, in calls of the device tool. The default model's GGUF
# travels in pieces (`split -b 33000000 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf
# .device-carry/smol.part`: part00..02); every stage parks the pieces it carries in /tmp, and the
# stages that need the model join them.
#   stage T: GPU tests                               (carry .whl .device-carry/smol.part00)
#   stage P: only park a piece                        (carry .whl .device-carry/smol.part01)
#   stage D: train the bundled DFlash draft + a classic draft, then they wait in /tmp/drafts
#                                                    (carry .whl .device-carry/smol.part02)
#   stage S: plain vs speculative decoding, same split, same run: the bundled draft (`default`,
#            draft/weights/) and the classic draft of stage D        (carry .whl [part02])
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
cp .device-carry/smol.part* /tmp/ 2>/dev/null
join_model() { [ -s "$gguf" ] || cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"; }
if [ "$stage" = T ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" -x 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.txt"
elif [ "$stage" = P ]; then
  ls -la /tmp/smol.part*
elif [ "$stage" = D ]; then
  join_model
  log train
  python3 -m draft.train --target default --out /tmp/drafts/smollm2-135m-dflash --device cuda:0 \
    --seconds "${TRAIN_S:-240}" --gen-batch 512 --classic-out /tmp/drafts/smollm2-135m-classic4 \
    --classic-seconds "${CLASSIC_S:-70}" --report "$OUT/train_report.json" 2>&1 \
    | grep -v Warning | tee "$OUT/train_log.txt" | tail -25
  (cd /tmp/drafts/smollm2-135m-dflash && cp config.json "$OUT/draft_config.json" && \
    split -b 8000000 -d -a 1 model.safetensors "$OUT/draft_model.part")
elif [ "$stage" = S ]; then
  join_model
  log speculative decoding, default model on "$devices"
  python3 bench/speculative.py --model default --devices "$devices" \
    --drafts "${DRAFTS:-default,/tmp/drafts/smollm2-135m-classic4}" \
    --new-tokens 256 --json "$OUT/spec.json" 2>&1 | tail -8 | tee "$OUT/spec.txt"
fi
log done
