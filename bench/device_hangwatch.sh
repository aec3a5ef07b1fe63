#!/usr/bin/env bash
# A device-tool call (2026-11-26, fourth session; bench/RESULTS.md, calls 3-5): the hybrid GPU
# tests (K: pytest -k expression) in the background, and the Python stacks of every process
# (py-spy, carried as .device-carry/tools/py-spy: a copy of the virtual env's static binary)
# once no test has ended for 90 s.
source bench/device_env.sh > /dev/null
python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts= -x --durations=0 \
  tests/shards/test_hybrid_gpu.py -k "${K:-captured or fused or conv or cli}" > $OUT/pytest.txt 2>&1 &
pid=$!
last=""; same=0
for i in $(seq 1 27); do
  sleep 15
  kill -0 $pid 2>/dev/null || break
  now=$(grep -c "PASSED\|FAILED" $OUT/pytest.txt)
  if [ "$now" = "$last" ]; then same=$((same+1)); else same=0; fi
  last=$now
  echo "t=$((i*15)) done=$now same=$same" >> $OUT/watch.txt
  if [ $same -ge 6 ]; then
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> $OUT/watch.txt
    .device-carry/tools/py-spy dump --native --pid $pid > $OUT/stack.txt 2>&1
    for c in $(pgrep -f "python" | grep -v "^$pid\$"); do
      .device-carry/tools/py-spy dump --native --pid $c >> $OUT/stack.txt 2>&1; done
    ps aux | grep -i python | head -20 >> $OUT/watch.txt
    kill -9 $pid; break
  fi
done
kill -9 $pid 2>/dev/null
tail -40 $OUT/pytest.txt; cat $OUT/watch.txt; grep -v '^ *0x\|libc\|pluggy\|_pytest' $OUT/stack.txt | head -150 2>/dev/null
