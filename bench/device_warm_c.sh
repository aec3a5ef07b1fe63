source bench/device_env.sh
grep -h "captured\|compil\|ready in\|listening\|KV pool of" /tmp/startup_on.full | grep -v "^W" | cut -c1-220 | head -60 > $OUT/startup_on_log.txt
python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rf --tb=short tests/gpu/test_warm.py "tests/gpu/test_gpu_path.py::test_graph_batched_decode_matches_single_steps" 2>&1 | grep -v "DEBUG\|INFO\|torch.__trace" | tail -15
[ -d /tmp/site-tf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-tf .whl-tf/*.whl > /dev/null 2>&1
timeout 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 bench/decode.py --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 16 --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 --kv-cache-gb 4 --hf --json "$OUT/prefill.json" 2>&1 | grep -v " INFO \| DEBUG " | tail -12
