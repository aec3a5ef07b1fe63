source bench/device_env.sh
LOG=$OUT/log.txt; deadline=560; source bench/device_stages.sh
run fusedtest 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= --tb=short tests/shards/test_hybrid_gpu.py::test_fused_compiled_steps_equal_unfused_on_cuda
run fused1 90 python3 bench/decode.py --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor --json $OUT/fused_h200.json
run unfused1 90 env LAYERSPLIT_FUSED_HYBRID=0 python3 bench/decode.py --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor --json $OUT/unfused_h200.json
grep -v "DEBUG\|INFO\|torch.__trace" /tmp/fusedtest.full | grep -B3 -A3 "Assert\|passed\|failed" > $OUT/fusedtest.txt
log done
