#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), one call of the device tool, carry .whl: where a
# chunked prefill's time goes (`bench/profile_prefill.py`), a 32K prompt on the Qwen3-8B shape in
# chunks of 256 (the CPU default), 2048, 8192 and in one piece (issue 21), and the Qwen3.5-27B
# shape in chunks of 8192 and in one piece (issue 20). Results: $OUT/log.txt.
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
TAIL=45
run dense 200 python3 bench/profile_prefill.py --model random:qwen3-8b --tokens 32768 \
  --chunks 256,2048,8192,32768
run hybrid 280 python3 bench/profile_prefill.py --model random:qwen3.5-27b --tokens 32768 \
  --chunks 8192,32768
log done
