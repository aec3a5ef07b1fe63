# Sourced by the bench/device_*.sh scripts, from the repository root on a device machine: $OUT
# made, the wheels the image lacks (carried in .whl: pyzmq, gguf, msgpack, xxhash, psutil,
# fla-core, einops, llguidance...) installed into /tmp/site, and the environment the runs share.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LAYERSPLIT_HOME=${LAYERSPLIT_HOME:-/tmp/lshome}
