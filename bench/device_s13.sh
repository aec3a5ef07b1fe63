#!/usr/bin/env bash
# Calls of the device tool (2026-11-28, thirteenth session) on `nvidia-h200-x2` (two H200 of one
# host; the issue-24 runs use one of them, 2 shards on the one GPU): speculation's floors with
# the twelfth session's verify-step attention, where a speculating round's time goes between
# the processes, and the two-GPU runs the GEMV kernels changed. Carry .whl in every call, and
# one piece of the real default model's GGUF (.device-carry/smol.part00..02) in each of the
# first three calls of a machine, back to back: the pieces wait in /tmp while the machine is held.
#   A (part00): the GPU tests of the last two sessions' kernels (the GEMV kernel's K-chunk
#      loads, the head's few-rows shape, verify tiles as programs), then the default model's
#      shape (random weights) decoding on 1 vs 2 GPUs.
#   B (part01): the Qwen3-8B and Llama-8B shapes on 1 vs 2 GPUs, and the cuda-ipc hop.
#   C (part02): greedy speculation, unseen prompts, one stream, 2 shards on one GPU (the floor's
#      setting); the same traced (LAYERSPLIT_STEP_TRACE, bench/step_timeline.py: where a round's
#      time goes); then greedy speculation with the 2 shards on 2 GPUs.
#   D: smaller token trees (31, 15, 7 draft tokens), and 8 streams each speculating.
#   P: (one GPU, three calls, each with its piece) parks the model's pieces, then
#   E: greedy speculation on the unseen prompts with the last shard moving a tree's kept rows as
#      soon as it sampled them, traced once more; the GPU test of those moves.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
spec="python3 bench/speculative.py --model default --drafts default --sets unseen"
one="--devices cuda:0,cuda:0"
case "${1:?stage A, B, C, D, P or E}" in
A)
  TAIL=8 run tests 330 $tests tests/gpu/test_gemv.py tests/gpu/test_batched_verify_gpu.py \
    tests/gpu/test_speculative_gpu.py tests/gpu/test_decode_kernels.py \
    -k "not 4500 and not past_the_static"
  TAIL=8 run smol_1v2 90 python3 bench/decode.py --model random:smollm2-135m-shape \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 2048 \
    --repeats 3 --json "$OUT/smol_1v2.json"
  ;;
B)
  TAIL=8 run qwen3_8b 100 python3 bench/decode.py --model random:qwen3-8b \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 4096 \
    --repeats 3 --json "$OUT/qwen3_8b.json"
  TAIL=8 run llama8b 100 python3 bench/decode.py --model random:llama-8b-shape \
    --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context 4096 \
    --repeats 3 --json "$OUT/llama8b.json"
  run hop 40 bash -c 'for i in 1 2 3 4 5; do python3 bench/hop_latency.py \
    --devices cuda:0,cuda:1 --transports cuda-ipc --tokens 1 --hidden 4096 --iters 1000 \
    2>&1 | tail -2; done'
  ;;
C)
  default_model
  TAIL=8 run greedy 170 $spec $one --new-tokens 256 --repeat 3 --json "$OUT/greedy.json"
  rm -rf /tmp/trace
  TAIL=4 run traced 80 env LAYERSPLIT_STEP_TRACE=/tmp/trace $spec $one --limit 6 \
    --new-tokens 256 --repeat 1
  TAIL=80 run timeline 20 python3 bench/step_timeline.py /tmp/trace --json "$OUT/timeline.json"
  tar czf "$OUT/trace.tgz" -C /tmp trace 2>/dev/null
  TAIL=8 run greedy_2gpu 170 $spec --devices cuda:0,cuda:1 --new-tokens 256 --repeat 3 \
    --json "$OUT/greedy_2gpu.json"
  ;;
D)
  default_model
  TAIL=10 run trees 300 $spec $one --new-tokens 256 --repeat 3 --trees 31,15,7 \
    --json "$OUT/trees.json"
  TAIL=8 run streams 200 $spec $one --streams 8 --ignore-eos --new-tokens 128 --repeat 3 \
    --json "$OUT/streams.json"
  ;;
P)
  log "parked: $(ls /tmp/smol.part* 2>/dev/null | tr '\n' ' ')"
  ;;
E)
  default_model
  TAIL=8 run greedy 160 $spec $one --new-tokens 256 --repeat 3 \
    --json "$OUT/greedy.json"
  rm -rf /tmp/trace
  TAIL=4 run traced 40 env LAYERSPLIT_STEP_TRACE=/tmp/trace $spec $one --limit 3 \
    --new-tokens 256 --repeat 1
  TAIL=40 run timeline 15 python3 bench/step_timeline.py /tmp/trace --json "$OUT/timeline.json"
  tar czf "$OUT/trace.tgz" -C /tmp trace 2>/dev/null
  TAIL=6 run kept_test 60 $tests tests/gpu/test_speculative_gpu.py -k kept_tree_rows
  ;;
esac
log done
