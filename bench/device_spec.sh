#!/usr/bin/env bash
# Speculative decoding on the device (`nvidia-h200-x2`), in calls of the device tool. The default
# model's GGUF travels in pieces (`split -b 33000000 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf
# .device-carry/smol.part`: part00..02); every stage parks the piece it carries in /tmp (the
# machine keeps /tmp while it stays warm), and the stages that need the model join them.
#   stage A: GPU tests                                  (carry .whl .device-carry/smol.part00)
#   stage P: only park a piece                           (carry .whl .device-carry/smol.part01)
#   stage D: train drafts, one per GPU: each GPU first generates its share of the data
#            (`--part i/N`, GEN_S seconds of answers), then every GPU trains one draft
#            configuration of CONFIGS on all of it (TRAIN_S seconds); GPU 0 then distils the
#            classic draft (CLASSIC_S). The drafts wait in /tmp/drafts; they come back packed in
#            $OUT/drafts.tar.part*, with the sequence files.  (carry .whl .device-carry/smol.part02)
#   stage L: one draft trained longer on one GPU: GEN_S seconds of new answers (to user turns the
#            target writes, seed of part 2) added to the sequence files carried in .device-carry
#            (data*.st, from stage D), then training until the call's 10 minutes are nearly
#            spent, with CONFIG's arguments (INIT=folder: going on from that draft, at LR);
#            the draft comes back packed in $OUT.
#                                         (carry .whl .device-carry/smol.part02 .device-carry/data0.st ...)
#   stage T: choose the bundled draft's token tree (NODES draft tokens) on the held-out answers
#            of .device-carry/val.st (`python -m layersplit.draft.tree`; the config comes back in $OUT), then
#            stage S with it              (carry .whl .device-carry/smol.part02 .device-carry/val.st)
#            val.st: the "val" sets of stage D's and L's sequence files, small enough to carry:
#            python -c "from pathlib import Path; from draft.train import load_sequences as l,
#            save_sequences as s; v = [l(Path(f))['val'] for f in ('data0.st', 'data1.st',
#            'data2.st')]; s(Path('.device-carry/val.st'), {'val': (sum((a for a, _ in v), []),
#            sum((b for _, b in v), []))})"
#   stage S: plain vs speculative decoding, same split, same run, for each draft of DRAFTS
#            (default: the bundled draft and the drafts of stage D), REPEAT times over (the
#            median ratio is printed last), each with token trees of TREES draft tokens (e.g.
#            TREES=0,15,31; default: the draft's own tree; PUSH=on,off: with the draft handing
#            its proposals to the first shard and without). Both prompt sets (eval, unseen:
#            bench/prompts/unseen.jsonl; SETS=unseen for one). Sampled: TEMP=0.7 TOP_P=0.9
#            SAMPLING=coupled,rejection,guesses (spec_sampling of each run; default coupled)
#                                                                       (carry .whl [part02])
set -uo pipefail
stage=${1:?stage A, P, D, L, T or S}
devices=${2:-cuda:0,cuda:1}
source bench/device_env.sh
mkdir -p $LAYERSPLIT_HOME/models /tmp/drafts
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
log() { echo "=== $* ($(date +%T))"; }
cp .device-carry/smol.part* /tmp/ 2>/dev/null
join_model() { [ -s "$gguf" ] || cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"; }
gpus=$(nvidia-smi -L | wc -l)
dev=${DEV:-cuda}  # DEV=cpu with a stand-in nvidia-smi: a dry run of the stages' plumbing
# draft configurations of stage D, one per GPU: name:extra arguments of draft.train
CONFIGS=${CONFIGS:-"l2:--layers 2;l3:--layers 3 --intermediate 1024"}
if [ "$stage" = T ]; then
  join_model
  log token tree of the bundled draft
  python3 -m layersplit.draft.tree default --data .device-carry/val.st --nodes "${NODES:-31}" \
    --device $dev:0 2>&1 | grep -v Warning | tail -4 | tee "$OUT/tree.txt"
  cp draft/weights/smollm2-135m-dflash/config.json "$OUT/"
  stage=S
fi
if [ "$stage" = A ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" 2>&1 \
    | tail -30 | tee "$OUT/gpu_tests.txt"
elif [ "$stage" = P ]; then
  ls -la /tmp/smol.part*
elif [ "$stage" = D ]; then
  join_model
  log generate on $gpus GPUs
  data=""
  for ((i = 0; i < gpus; i++)); do
    timeout "${GEN_TIMEOUT:-300}" python3 -m layersplit.draft.train --device $dev:$i --part $i/$gpus \
      --gen-seconds "${GEN_S:-150}" ${GEN_ARGS:---self-prompts 16000} --save-data /tmp/drafts/data$i.st > /tmp/drafts/gen$i.log 2>&1 &
    data=${data:+$data,}/tmp/drafts/data$i.st
  done
  wait
  grep -h -v Warning /tmp/drafts/gen*.log | grep -E "turns|sequences|budget|wrote|Error" | cut -c1-400
  log train: $CONFIGS
  IFS=';' read -ra configs <<< "$CONFIGS"
  for ((i = 0; i < ${#configs[@]} && i < gpus; i++)); do
    name=${configs[$i]%%:*}
    extra=${configs[$i]#*:}
    classic=""
    [ $i = 0 ] && [ "${CLASSIC_S:-40}" != 0 ] && classic="--classic-out /tmp/drafts/classic4 \
      --classic-seconds ${CLASSIC_S:-40}"
    timeout "${TRAIN_TIMEOUT:-320}" python3 -m layersplit.draft.train --device $dev:$i --data "$data" \
      --out /tmp/drafts/$name --seconds "${TRAIN_S:-180}" $extra $classic --report /tmp/drafts/report_$name.json \
      > /tmp/drafts/train_$name.log 2>&1 &
  done
  wait
  for f in /tmp/drafts/train_*.log; do
    echo "--- $f"; grep -v Warning "$f" | grep -E "step|trained|before|rows|classic|Error|error" | tail -40
  done
  (cd /tmp/drafts && tar cf - --exclude classic4 --exclude '*.log' . | split -b 15000000 -d -a 1 - "$OUT/drafts.tar.part")
  cat /tmp/drafts/*.log | grep -v Warning > "$OUT/logs.txt"
elif [ "$stage" = L ]; then
  join_model
  log generate on one GPU
  timeout 300 python3 -m layersplit.draft.train --device $dev:0 --part 2/3 --prompts 0 --code-files 0 \
    --self-prompts "${SELF_PROMPTS:-24000}" --gen-seconds "${GEN_S:-100}" --save-data /tmp/drafts/data2.st 2>&1 \
    | grep -v Warning | grep -E "turns|sequences|budget|wrote|Error" | cut -c1-300
  data=$(ls .device-carry/data*.st /tmp/drafts/data2.st | paste -sd,)
  left=$(( ${CALL_S:-590} - SECONDS - 90 ))
  log train ${CONFIG:=--layers 3 --intermediate 1024} for $left s on $data
  python3 -m layersplit.draft.train --device $dev:0 --data "$data" --out /tmp/drafts/long --seconds $left \
    $CONFIG ${INIT:+--init $INIT} ${LR:+--lr $LR} --report /tmp/drafts/report_long.json 2>&1 | grep -v Warning \
    | grep -E "step|trained|before|rows|wrote|Error|error"
  cp /tmp/drafts/report_long.json "$OUT/"
  (cd /tmp/drafts && tar cf - long data2.st | split -b 15000000 -d -a 1 - "$OUT/long.tar.part")
elif [ "$stage" = S ]; then
  join_model
  log speculative decoding, default model on "$devices"
  drafts=default
  for d in /tmp/drafts/*/; do [ -f "$d/config.json" ] && drafts=$drafts,${d%/}; done
  python3 bench/speculative.py --model default --devices "$devices" --drafts "${DRAFTS:-$drafts}" \
    --new-tokens 256 --repeat "${REPEAT:-1}" ${TREES:+--trees $TREES} ${PUSH:+--push $PUSH} \
    ${SETS:+--sets $SETS} ${TEMP:+--temperature $TEMP} ${TOP_P:+--top-p $TOP_P} \
    ${SAMPLING:+--sampling $SAMPLING} \
    ${DRAFT_DEVICES:+--draft-devices $DRAFT_DEVICES} ${DTYPE:+--dtype $DTYPE} --json "$OUT/spec.json" 2>&1 | tail -40 \
    | tee "$OUT/spec.txt"
  python3 -c "import json
for r in json.load(open('$OUT/spec.json')):
    print(r['draft'], r.get('set'), {k: round(r[k], 3) for k in ('prepared', 'off_chain', 'verdict_lag_ms',
          'request_lag_ms', 'ready_lead_ms', 'draft_ms', 'verify_ms') if k in r})" | tee -a "$OUT/spec.txt"
fi
log done
