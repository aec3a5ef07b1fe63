# Sourced by bench/device.sh on a device machine, from the repository root (bench/README.md
# says what to carry there and why). It installs the wheels the machine lacks, sets the
# environment every stage shares, and defines the helpers the stages use:
#   log MSG               a line in $LOG, stamped with the seconds since the call began
#   run NAME EST CMD...   CMD, only if EST seconds fit before the deadline, cut there at the latest;
#                         its whole output in $RUNS/NAME.log, its last $TAIL lines (INFO and DEBUG
#                         left out) in $LOG
#   row KIND ARGS...      bench/results_row.py: RESULTS.md rows from a bench's JSON, into $ROWS
#   default_model         the real default model's GGUF in $LAYERSPLIT_HOME/models, joined from
#                         its three pieces parked in /tmp (one piece carried per call)
#   random_gguf SHAPE T F a random-weight GGUF of configs/models/SHAPE, type T, with the default
#                         model's vocabulary (.device-carry/smol_vocab.json.gz), as file F
#   lcp_start / lcp_wait  llama.cpp (llama-cpp-python with CUDA) built in the background from
#                         .device-carry/lcp.tgz into /tmp/lcpsite, and the random-weight GGUFs of
#                         the default model's and the Llama-8B shapes it reads; /tmp/lcp.done once
#                         built; lcp_wait waits for it until the deadline less its argument (s)
#   lcp NAME GGUF         llama.cpp's decode and prefill of GGUF on GPU 0 into $RUNS/lcp_NAME.json
#                         (and /tmp, for later calls on the same machine)
#   install_tf            transformers and what it needs (.whl-tf) into /tmp/site-tf, for --hf
# Environment it reads: OUT (default /tmp/out), DEADLINE (seconds into the call after which no
# run starts, default 580), LAYERSPLIT_HOME (default /tmp/lshome), COMMIT (the commit the rows
# name; default: git's HEAD where .git travelled, else "—"), TAIL (default 30).
OUT=${OUT:-/tmp/out}
RUNS=$OUT/runs
mkdir -p "$RUNS"
LOG=$OUT/log.txt
ROWS=$OUT/rows.md
deadline=${DEADLINE:-580}
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "device_env: the wheels in .whl did not install"; exit 1; }
fi
if ls .whl-srv/*.whl > /dev/null 2>&1; then  # (the server's wheels, for calls that carry them)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl-srv/*.whl || { echo "device_env: the wheels in .whl-srv did not install"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LAYERSPLIT_HOME=${LAYERSPLIT_HOME:-/tmp/lshome}
# (NVLink multicast stays off: a program using it can take a shared multi-GPU host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)
gpu_name=${gpu_name#NVIDIA }
gpu_name=${gpu_name%% *}  # H200, H100
if [ "${GPUS:-0}" -gt 1 ]; then gpu_name="${GPUS}×$gpu_name"; fi
export RESULTS_DEVICE=${RESULTS_DEVICE:-${gpu_name:-CPU ($(nproc) cores)}}
export RESULTS_DATE=${RESULTS_DATE:-$(date -u +%F)}
export RESULTS_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo —)}
tests="python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf --tb=short"
export LAYERSPLIT_TEST_FAILURES=$OUT/failures.txt  # (each failure as it happens: tests/conftest.py)

log() { echo "=== $* (t=${SECONDS}s, $(date +%T))" | tee -a "$LOG"; }
want() { ((SECONDS + $2 < deadline)) || { log "skip $1: it may not end by t=${deadline}s"; false; }; }
run() {
  local name=$1 est=$2
  shift 2
  want "$name" "$est" || return 1
  log "$name: $*"
  timeout $((deadline - SECONDS)) "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc" >> "$RUNS/$name.log"
  grep -v " INFO \| DEBUG " "$RUNS/$name.log" | tail -"${TAIL:-30}" | tee -a "$LOG"
  return $rc
}
row() {  # KIND FILE ...: nothing when the bench wrote no FILE (skipped, or it failed)
  [ -e "$2" ] || { log "no $2: no row"; return 1; }
  python3 bench/results_row.py "$@" | tee -a "$ROWS" "$LOG"
}

cp .device-carry/smol.part* /tmp/ 2> /dev/null  # each call parks the piece it carries
default_model() {
  local gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -s "$gguf" ] && return 0
  [ -s /tmp/smol.part00 ] && [ -s /tmp/smol.part01 ] && [ -s /tmp/smol.part02 ] || {
    log "the default model's pieces are not all parked in /tmp: $(ls /tmp/smol.part* 2> /dev/null \
      | tr '\n' ' ')(carry one of .device-carry/smol.part00..02 in each of three calls)"
    return 1
  }
  mkdir -p "$LAYERSPLIT_HOME/models"
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 > "$gguf"
  log "default model: $(sha256sum "$gguf")"
}
random_gguf() {
  [ -s "$3" ] && return 0
  mkdir -p "$(dirname "$3")"
  python3 bench/random_gguf.py --shape "configs/models/$1" \
    --vocab .device-carry/smol_vocab.json.gz --type "$2" "$3" > "$RUNS/random_gguf.log" 2>&1 ||
    { log "random_gguf $1: $(tail -2 "$RUNS/random_gguf.log")"; return 1; }
}
lcp_start() {
  [ -e /tmp/lcp.done ] || [ -e /tmp/lcp.pid ] && return 0
  [ -s .device-carry/lcp.tgz ] || { log "llama.cpp: .device-carry/lcp.tgz not carried"; return 1; }
  log "llama.cpp: building in the background (/tmp/lcp.log)"
  setsid bash -c '
    set -e
    tar xzf .device-carry/lcp.tgz -C /tmp
    (cd /tmp/llama_cpp_python-0.3.36 &&
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice -n 19 python3 -m pip install -q \
        --no-build-isolation --no-deps --target /tmp/lcpsite .)
    if ls .whl/diskcache-*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/lcpsite .whl/diskcache-*.whl
    fi
    for s in "smollm2-135m-shape q4_1 /tmp/smol-q4_1.gguf" "llama-8b-shape f16 /tmp/llama8b-f16.gguf"; do
      set -- $s
      [ -s "$3" ] || nice -n 19 python3 bench/random_gguf.py --shape "configs/models/$1" \
        --vocab .device-carry/smol_vocab.json.gz --type "$2" "$3"
    done
    touch /tmp/lcp.done' > /tmp/lcp.log 2>&1 < /dev/null &
  echo $! > /tmp/lcp.pid
}
lcp_wait() {
  while [ ! -e /tmp/lcp.done ] && [ -e /tmp/lcp.pid ] && kill -0 "$(cat /tmp/lcp.pid)" 2> /dev/null \
    && ((SECONDS < deadline - ${1:-0})); do sleep 5; done
  [ -e /tmp/lcp.done ] || { log "llama.cpp not built: $(tail -3 /tmp/lcp.log 2> /dev/null)"; return 1; }
}
lcp() {
  [ -e /tmp/lcp.done ] || return 1
  run "lcp_$1" 60 env CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/lcpsite:$PYTHONPATH python3 \
    bench/llamacpp_decode.py "$2" --split none --json "$RUNS/lcp_$1.json" && cp "$RUNS/lcp_$1.json" /tmp/
}
install_tf() {
  [ -d /tmp/site-tf ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-tf .whl-tf/*.whl > /dev/null 2>&1 || { log "the wheels in .whl-tf did not install"; return 1; }
}
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee -a "$LOG"
log "device $RESULTS_DEVICE, date $RESULTS_DATE, commit $RESULTS_COMMIT"
