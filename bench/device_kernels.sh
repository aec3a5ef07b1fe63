#!/usr/bin/env bash
# GPU runs of issue 21 (the Triton decode kernels, `shards.kernels`) on one GPU, in one call of
# the device tool, from the repository root with the pyzmq wheel in .whl/:
#   bash bench/device_kernels.sh [STAGES]      STAGES: comma-separated, default all:
#   tests     python3 -m pytest tests/gpu/test_decode_kernels.py (kernels vs the torch path)
#   micro     python3 bench/attention_kernel.py (one layer's attention stage, torch vs kernel)
#   profile   bench/profile_decode.py, default model's shape, kernels on (1) and off (0)
#   decode    bench/decode.py, default model's shape, 3 runs, kernels on and off
#   profile8b, decode8b    the same for random:qwen3-8b
#   gputests  the other GPU tests of the decode path (graphs, batched, verify)
# Everything stops starting new stages after DEADLINE seconds (default 480). Logs: $OUT/log.txt.
set -uo pipefail
source bench/device_env.sh
stages=${1:-tests,micro,profile,decode,profile8b,decode8b,gputests}
deadline=${DEADLINE:-480}
LOG=$OUT/log.txt
log() { echo "=== $* (t=${SECONDS}s)" | tee -a "$LOG"; }
want() { [[ ",$stages," == *",$1,"* ]] && { ((SECONDS < deadline)) || { log "skip $1: deadline"; false; }; }; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  2>&1 | tee -a "$LOG"
if want tests; then
  log "kernel tests: python3 -m pytest -q tests/gpu/test_decode_kernels.py"
  timeout 300 python3 -m pytest -q tests/gpu/test_decode_kernels.py -p no:cacheprovider \
    -o addopts="" 2>&1 | tail -25 | tee -a "$LOG"
fi
if want micro; then
  log "attention stage: python3 bench/attention_kernel.py"
  timeout 200 python3 bench/attention_kernel.py 2>&1 | tail -12 | tee -a "$LOG"
fi
for model in smol 8b; do
  [ $model = smol ] && m=random:smollm2-135m-shape || m=random:qwen3-8b
  [ $model = smol ] && ctx=2048 || ctx=4096
  sfx=$([ $model = smol ] || echo 8b)
  if want "profile$sfx"; then
    for k in 1 0; do
      log "LAYERSPLIT_FUSED_KERNELS=$k python3 bench/profile_decode.py --model $m"
      LAYERSPLIT_FUSED_KERNELS=$k timeout 240 python3 bench/profile_decode.py --model $m \
        2>&1 | tail -24 | tee -a "$LOG"
    done
  fi
  if want "decode$sfx"; then
    for k in 1 0; do
      log "LAYERSPLIT_FUSED_KERNELS=$k python3 bench/decode.py --model $m --layouts cuda:0 --prompt-len 512 --new-tokens 256 --max-context $ctx --repeats 3"
      LAYERSPLIT_FUSED_KERNELS=$k timeout 300 python3 bench/decode.py --model $m \
        --layouts cuda:0 --prompt-len 512 --new-tokens 256 --max-context $ctx --repeats 3 \
        --json "$OUT/decode_${model}_k$k.json" 2>&1 | tail -5 | tee -a "$LOG"
    done
  fi
done
if want gputests; then
  t=tests/gpu
  log "GPU tests of the decode path (graphs, batched, verify)"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    $t/test_gpu_path.py::test_graph_decode_matches_eager_and_cpu \
    $t/test_gpu_path.py::test_bf16_graph_decode_tracks_eager \
    $t/test_gpu_path.py::test_graph_batched_decode_matches_single_steps \
    $t/test_speculative_gpu.py::test_graph_verify_matches_eager_rows_and_cpu 2>&1 \
    | tail -15 | tee -a "$LOG"
fi
log done
