#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), the hybrid model's runs (issue 20), two
# back-to-back calls of the device tool:
#   call A: bash bench/device_hybrid.sh A    carry .whl
#           the Qwen3.5-27B shape's decode with the fused hybrid step (1 and 2 shards) and,
#           same call, unfused (LAYERSPLIT_FUSED_HYBRID=0); the hybrid GPU tests
#   call B: bash bench/device_hybrid.sh B    carry .whl .whl-tf
#           prefill of 8K and 32K tokens next to transformers' own Qwen3.5 (its fla-core
#           kernels; .whl-tf holds transformers and the dependencies the image lacks); the
#           decode-kernel and token-mask GPU tests
# A stage starts only if its estimate fits before DEADLINE seconds (default 580) and is cut
# there. Results: $OUT/log.txt and the benches' JSON.
set -uo pipefail
stage=${1:?stage A or B}
source bench/device_env.sh
deadline=${DEADLINE:-580}
LOG=$OUT/log.txt
source bench/device_stages.sh
tests="python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf"
model=random:qwen3.5-27b
if [ "$stage" = A ]; then
  run fused 220 python3 bench/decode.py --model $model --layouts cuda:0 cuda:0,cuda:0 \
    --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor \
    --json "$OUT/fused.json"
  run unfused 130 env LAYERSPLIT_FUSED_HYBRID=0 python3 bench/decode.py --model $model \
    --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor \
    --json "$OUT/unfused.json"
  run tests_hybrid 150 $tests tests/shards/test_hybrid_gpu.py
elif [ "$stage" = B ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-tf .whl-tf/*.whl > /dev/null 2>&1 || log "transformers wheels failed"
  run prefill 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py --model $model \
    --layouts cuda:0 --prompt-len 512 --new-tokens 16 --max-context 40960 --repeats 1 \
    --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 --hf --json "$OUT/prefill.json"
  run tests_kernels 240 $tests --tb=short tests/gpu/test_decode_kernels.py \
    tests/gpu/test_token_mask.py \
    tests/shards/test_hybrid_gpu.py::test_fused_compiled_steps_equal_unfused_on_cuda
  grep -v "DEBUG\|INFO\|torch.__trace" /tmp/tests_kernels.full > "$OUT/tests_kernels.txt"
fi
log done
