#!/usr/bin/env bash
# GPU runs for bench/RESULTS.md on `nvidia-h200-x2`, in calls of the device tool. The default
# model's GGUF is larger than one call may carry, so it travels in three pieces
# (`split -b 33000000 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf .device-carry/smol.part`); each
# stage parks the piece it carries in /tmp (the machine keeps /tmp while it stays warm).
#   stage A: GPU tests, hop latency                   (carry .whl .device-carry/smol.part00)
#   stage B: decode of the default model's shape (seeded random weights: same speed), 1 vs 2
#            GPUs, and its profile                    (carry .whl .device-carry/smol.part01)
#   stage C: the default model: generate on 2 GPUs, decode 1 vs 2 GPUs (two runs), speculative
#            decoding, prefix cache                   (carry .whl .device-carry/smol.part02)
#   stage D: 8B shapes                                (carry .whl)
set -uo pipefail
stage=${1:?stage 1 or 2}
source bench/device_env.sh
export LAYERSPLIT_HOME=/tmp/lshome
mkdir -p $LAYERSPLIT_HOME/models
log() { echo "=== $* ($(date +%T))"; }
cp .device-carry/smol.part* /tmp/ 2>/dev/null
gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$stage" = A ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  log hop latency
  python3 bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc,shm,zmq-ipc \
    --iters 300 --json "$OUT/hop_gpu.json" 2>&1 | tail -20 | tee "$OUT/hop_gpu.txt"
elif [ "$stage" = B ]; then
  log unit costs of a hop
  python3 bench/cuda_unit_costs.py 2>&1 | tee "$OUT/unit_costs.txt"
  log hop latency, cuda-ipc
  python3 bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc --hidden 576,4096 \
    --iters 1000 --json "$OUT/hop_ipc.json" 2>&1 | tail -6 | tee "$OUT/hop_ipc.txt"
  log default model shape, decode 1 vs 2 GPUs
  python3 bench/decode.py --model random:smollm2-135m-shape --layouts cuda:0 cuda:0,cuda:1 \
    --prompt-len 512 --new-tokens 256 --max-context 2048 --json "$OUT/decode_smol_shape.json" \
    2>&1 | tail -6 | tee "$OUT/decode_smol_shape.txt"
  log profile
  python3 bench/profile_decode.py --model random:smollm2-135m-shape 2>&1 | tail -3 \
    | tee "$OUT/profile_smol_shape.txt"
elif [ "$stage" = C ]; then
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"
  log generate on two GPUs
  python3 -m layersplit.launch.cli generate "What is the capital of France?" --chat \
    --config configs/smollm2-2gpu.toml 2>&1 | tail -4 | tee "$OUT/generate_2gpu.txt"
  for run in 1 2; do
    log default model decode, 1 vs 2 GPUs, run $run
    python3 bench/decode.py --model default --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
      --new-tokens 256 --max-context 2048 --json "$OUT/decode_smollm2_$run.json" 2>&1 | tail -6 \
      | tee "$OUT/decode_smollm2_$run.txt"
  done
  log speculative decoding, default model on cuda:0,cuda:1
  python3 bench/speculative.py --model default --devices cuda:0,cuda:1 --drafts default \
    --new-tokens 256 --json "$OUT/spec.json" 2>&1 | tail -8 | tee "$OUT/spec.txt"
  if [ "${PREFIX:-0}" = 1 ]; then
    log default model prefix cache
    python3 bench/prefix_cache.py --model default --devices cuda:0,cuda:1 --lengths 1024,4096,8000 \
      --json "$OUT/prefix_smollm2.json" --dir /tmp/pcbench 2>&1 | tail -6 | tee "$OUT/prefix_smollm2.txt"
  fi
elif [ "$stage" = D ]; then  # 8B shapes
  log 8B decode
  python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
    --new-tokens 256 --max-context 33792 --prefill 8192,32768 --prefill-chunk 32768 --hf --floor \
    --json "$OUT/decode_qwen3_8b.json" 2>&1 | tail -8 | tee "$OUT/decode_qwen3_8b.txt"
  log llama 8B shape
  python3 bench/decode.py --model random:llama-8b-shape --layouts cuda:0 cuda:0,cuda:1 \
    --prompt-len 512 --new-tokens 256 --max-context 4096 --prefill 3900 --prefill-chunk 4096 \
    --floor --json "$OUT/decode_llama_8b.json" 2>&1 | tail -7 | tee "$OUT/decode_llama_8b.txt"
  log 8B prefix cache
  python3 bench/prefix_cache.py --model random:qwen3-8b --devices cuda:0,cuda:1 \
    --lengths 1024,8192,32768 --prefill-chunk 2048 --json "$OUT/prefix_8b.json" --dir /tmp/pc8b \
    2>&1 | tail -6 | tee "$OUT/prefix_8b.txt"
fi
log done
