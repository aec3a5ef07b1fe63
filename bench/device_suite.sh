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
if [ "$stage" = quick ]; then  # diagnostics: no model files needed (random weights)
  log hop latency
  python3 bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc,shm,zmq-ipc \
    --hidden 576,4096,8192 --iters 300 --json "$OUT/hop_gpu.json" 2>&1 | tail -12 | tee "$OUT/hop_gpu.txt"
  log profile
  python3 bench/profile_decode.py --model random:qwen3-8b 2>&1 | tail -22 | tee "$OUT/profile_8b.txt"
  python3 bench/profile_decode.py --model random:qwen3-8b --no-compile 2>&1 | tail -3 | tee -a "$OUT/profile_8b.txt"
  log smollm2 shape decode
  python3 bench/decode.py --model random:smollm2-135m-shape --layouts cuda:0 cuda:0,cuda:1 \
    --prompt-len 512 --new-tokens 256 --max-context 2048 2>&1 | tail -6 | tee "$OUT/decode_smol_shape.txt"
  log 8B decode
  python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --floor 2>&1 | tail -7 | tee "$OUT/decode_8b.txt"
elif [ "$stage" = 1 ]; then
  cp .device-carry/smol.part00 /tmp/smol.part00
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
  nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
  log gpu tests
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
  log hop latency
  python3 bench/hop_latency.py --devices cuda:0,cuda:1 --transports cuda-ipc,shm,zmq-ipc \
    --iters 300 --json "$OUT/hop_gpu.json" 2>&1 | tail -14 | tee "$OUT/hop_gpu.txt"
else
  cat /tmp/smol.part00 .device-carry/smol.part01 > $LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
  log generate on two GPUs
  python3 -m launch.cli generate "What is the capital of France?" --chat \
    --config configs/smollm2-2gpu.toml 2>&1 | tail -6 | tee "$OUT/generate_2gpu.txt"
  log default model decode, 1 vs 2 GPUs
  python3 bench/decode.py --model default --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
    --new-tokens 256 --max-context 2048 --hf --json "$OUT/decode_smollm2.json" 2>&1 | tail -8 \
    | tee "$OUT/decode_smollm2.txt"
  log 8B shape
  python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 cuda:0,cuda:1 --prompt-len 512 \
    --new-tokens 256 --max-context 33792 --prefill 8192,32768 --prefill-chunk 32768 --hf --floor \
    --json "$OUT/decode_qwen3_8b.json" 2>&1 | tail -9 | tee "$OUT/decode_qwen3_8b.txt"
  log llama 8B shape
  python3 bench/decode.py --model random:llama-8b-shape --layouts cuda:0 cuda:0,cuda:1 \
    --prompt-len 512 --new-tokens 256 --max-context 4096 --prefill 3900 --prefill-chunk 4096 \
    --floor --json "$OUT/decode_llama_8b.json" 2>&1 | tail -8 | tee "$OUT/decode_llama_8b.txt"
fi
log done
