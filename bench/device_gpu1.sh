#!/usr/bin/env bash
# One GPU (`nvidia-h200` / `nvidia-h100-x1`), three back-to-back calls of the device tool; the
# default model's GGUF travels in three pieces (`split -b 33000000 -d -a 2
# SmolLM2-135M-Instruct.Q4_1.gguf .device-carry/smol.part`), each call parking its piece in /tmp.
#   call A: bash bench/device_gpu1.sh A    carry .whl .device-carry/smol.part00
#           GPU tests of the token-mask kernel and of the hybrid path (fla-core, captured decode
#           steps); the Qwen3.5-27B shape's decode, captured vs eager (1 shard), and 2 shards
#   call B: bash bench/device_gpu1.sh B    carry .whl .device-carry/smol.part01
#           the decode kernels' and the GPU path's tests; the default shape's decode on 2 shards
#           with torch's recompile warnings counted
#   call C: bash bench/device_gpu1.sh C    carry .whl .device-carry/smol.part02
#           structured output vs free text (1 and 2 shards); speculative decoding on unseen
#           prompts, greedy and at temperature 0.7 / top-p 0.9 (2 shards on the one GPU)
#   call D: bash bench/device_gpu1.sh D    carry .whl .device-carry/smol_vocab.json.gz
#           (one call, no model piece) the hybrid GPU tests; structured output vs free text on
#           a random-weight GGUF of the default model's shape and vocabulary (bench/random_gguf.py)
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
stage=${1:?stage A, B, C or D}
source bench/device_env.sh
mkdir -p $LAYERSPLIT_HOME/models
cp .device-carry/smol.part* /tmp/ 2>/dev/null
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
deadline=${DEADLINE:-580}
LOG=$OUT/log.txt
source bench/device_stages.sh
tests="python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf"
if [ "$stage" = A ]; then
  run tests_a 150 $tests tests/gpu/test_token_mask.py tests/shards/test_logits_processors.py \
    tests/shards/test_hybrid_gpu.py
  run hybrid 200 python3 bench/decode.py --model random:qwen3.5-27b \
    --layouts cuda:0 cuda:0,cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 \
    --repeats 3 --floor --json "$OUT/hybrid.json"
  run hybrid_eager 90 python3 bench/decode.py --model random:qwen3.5-27b --layouts cuda:0 \
    --prompt-len 512 --new-tokens 64 --max-context 4096 --repeats 3 --no-graphs \
    --json "$OUT/hybrid_eager.json"
elif [ "$stage" = B ]; then
  run tests_a 150 $tests tests/gpu/test_token_mask.py tests/shards/test_logits_processors.py \
    tests/shards/test_hybrid_gpu.py
  run tests_b 240 $tests tests/gpu/test_decode_kernels.py tests/gpu/test_gpu_path.py
  run smol_shape 90 python3 bench/decode.py --model random:smollm2-135m-shape \
    --layouts cuda:0 cuda:0,cuda:0 --prompt-len 512 --new-tokens 256 --max-context 2048 \
    --repeats 3 --json "$OUT/smol_shape.json"
  log "recompile warnings: $(grep -ci recompile /tmp/smol_shape.full)"
  grep -i -m3 recompile /tmp/smol_shape.full | cut -c1-300 | tee -a "$LOG"
elif [ "$stage" = C ]; then
  [ -s "$gguf" ] || cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"
  ls -la "$gguf" | tee -a "$LOG"
  run structured 200 python3 bench/structured_output.py --model default \
    --layouts cuda:0 cuda:0,cuda:0 --new-tokens 256 --repeats 3 --json "$OUT/structured.json"
  run spec_greedy 120 python3 bench/speculative.py --model default --devices cuda:0,cuda:0 \
    --drafts default --new-tokens 256 --repeat 3 --sets unseen --json "$OUT/spec_greedy.json"
  run spec_sampled 150 python3 bench/speculative.py --model default --devices cuda:0,cuda:0 \
    --drafts default --new-tokens 256 --repeat 3 --sets unseen --temperature 0.7 --top-p 0.9 \
    --sampling coupled,rejection,guesses --json "$OUT/spec_sampled.json"
elif [ "$stage" = D ]; then  # no model piece: a random-weight GGUF of the default shape
  run tests_hybrid 150 $tests tests/shards/test_hybrid_gpu.py
  python3 bench/random_gguf.py --shape configs/models/smollm2-135m-shape \
    --vocab .device-carry/smol_vocab.json.gz --type q4_1 /tmp/smol-q4_1.gguf 2>&1 | tail -1
  run structured 200 python3 bench/structured_output.py --model /tmp/smol-q4_1.gguf \
    --layouts cuda:0 cuda:0,cuda:0 --new-tokens 256 --repeats 3 --json "$OUT/structured.json"
fi
log done
