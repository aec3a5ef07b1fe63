# Sourced by device scripts that run named stages against one call's time (bench/device_x2.sh,
# bench/device_gpu1.sh, ...), after bench/device_env.sh. `deadline` (seconds into the call;
# default $DEADLINE or 580) and `LOG` (default $OUT/log.txt) may be set before; `tests` is the
# GPU test command; the GPUs are listed in the log.
#   run NAME EST CMD...   starts CMD only if EST seconds fit before the deadline, cuts it there
#                         at the latest; its last ${TAIL:-30} lines (INFO/DEBUG left out) go to
#                         the log, the whole output to /tmp/NAME.full (8 files come back)
#   default_model         the real default model's GGUF into $LAYERSPLIT_HOME from the three pieces
#                         (.device-carry/smol.part00..02, one carried per call: each call parks
#                         its piece in /tmp, where it stays while the machine is held)
#   lcp_build             llama.cpp (llama-cpp-python with CUDA, for sm_90) and the random-weight
#                         GGUFs of the default model's and the Llama-8B shapes, niced, in the
#                         background (carry .device-carry/lcp.tgz, .device-carry/smol_vocab.json.gz
#                         and .whl); /tmp/lcp.done once done, its log in /tmp/lcp.log
log() { echo "=== $* (t=${SECONDS}s, $(date +%T))" | tee -a "$LOG"; }
want() { ((SECONDS + $2 < deadline)) || { log "skip $1: it may not end by t=${deadline}s"; false; }; }
run() {
  local name=$1 est=$2; shift 2
  want "$name" "$est" || return 0
  log "$name"
  timeout $((deadline - SECONDS)) "$@" > "/tmp/$name.full" 2>&1
  echo "rc=$?" >> "/tmp/$name.full"
  grep -v " INFO \| DEBUG " "/tmp/$name.full" | tail -"${TAIL:-30}" | tee -a "$LOG"
}
deadline=${deadline:-${DEADLINE:-580}}
LOG=${LOG:-$OUT/log.txt}
tests="python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf --tb=short"
# transformers and the dependencies the image lacks (carried in .whl-tf), for `--hf` runs:
# PYTHONPATH=$PYTHONPATH:/tmp/site-tf
install_tf() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-tf .whl-tf/*.whl > /dev/null 2>&1 || log "transformers wheels failed"
}
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee -a "$LOG"
lcp_build() {
  setsid bash -c '
    tar xzf .device-carry/lcp.tgz -C /tmp && cd /tmp/llama_cpp_python-0.3.36 &&
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off" \
      CMAKE_BUILD_PARALLEL_LEVEL=12 nice -n 19 python3 -m pip install -q --no-build-isolation \
      --no-deps --target /tmp/lcpsite . && cd - &&
      { ls .whl/diskcache-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index \
          --no-deps --target /tmp/lcpsite .whl/diskcache-*.whl || true; } &&
      nice -n 19 python3 bench/random_gguf.py --shape configs/models/smollm2-135m-shape \
        --vocab .device-carry/smol_vocab.json.gz --type q4_1 /tmp/smol-q4_1.gguf &&
      nice -n 19 python3 bench/random_gguf.py --shape configs/models/llama-8b-shape \
        --vocab .device-carry/smol_vocab.json.gz --type f16 /tmp/llama8b-f16.gguf &&
      touch /tmp/lcp.done' > /tmp/lcp.log 2>&1 < /dev/null &
  echo $! > /tmp/lcp.pid
}
cp .device-carry/smol.part* /tmp/ 2>/dev/null
default_model() {
  [ -s /tmp/smol.part00 ] && [ -s /tmp/smol.part01 ] && [ -s /tmp/smol.part02 ] || {
    log "the model's pieces are not all parked in /tmp (three calls)"; exit 1; }
  mkdir -p "$LAYERSPLIT_HOME/models"
  [ -s "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] ||
    cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
      > "$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  log "default model: $(sha256sum "$LAYERSPLIT_HOME"/models/*.gguf)"
}
