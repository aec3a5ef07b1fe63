#!/usr/bin/env bash
# GPU runs for bench/RESULTS.md, in two calls of the device tool (the default model's GGUF is
# larger than one call may carry, so it travels in two pieces: .device-carry/smol.part00/01).
#   stage 1: GPU tests, hop latency                      (carry .whl .device-carry/smol.part00)
#   stage 2: generate on 2 GPUs, decode/prefill benches  (carry .whl .device-carry/smol.part01)
set -uo pipefail
stage=${1:?stage 1 or 2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LAYERSPLIT_HOME=/tmp/lshome
mkdir -p $LAYERSPLIT_HOME/models
log() { echo "=== $* ($(date +%T))"; }
if [ "$stage" = A ]; then  # GPU tests, hop latency, profile   (carry .whl .device-carry/smol.part00)
  cp .device-carry/smol.part00 /tmp/smol.part00
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  log hop latency
  python3 bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc,shm,zmq-ipc \
    --iters 300 --json "$OUT/hop_gpu.json" 2>&1 | tail -12 | tee "$OUT/hop_gpu.txt"
  log profile
  python3 bench/profile_decode.py --model random:qwen3-8b 2>&1 | tail -3 | tee "$OUT/profile_8b.txt"
elif [ "$stage" = B ]; then  # the default model               (carry .whl .device-carry/smol.part01)
  cat /tmp/smol.part00 .device-carry/smol.part01 > $LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
  log generate on two GPUs
  python3 -m launch.cli generate "What is the capital of France?" --chat \
    --config configs/smollm2-2gpu.toml 2>&1 | tail -4 | tee "$OUT/generate_2gpu.txt"
  log default model decode, 1 vs 2 GPUs
  python3 bench/decode.py --model default --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --hf --json "$OUT/decode_smollm2.json" 2>&1 | tail -7 \
    | tee "$OUT/decode_smollm2.txt"
  log default model prefix cache
  python3 bench/prefix_cache.py --model default --devices cuda:0,cuda:1 --lengths 1024,4096,8000 \
    --json "$OUT/prefix_smollm2.json" --dir /tmp/pcbench 2>&1 | tail -6 | tee "$OUT/prefix_smollm2.txt"
elif [ "$stage" = C ]; then  # 8B shapes                         (carry .whl)
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
