#!/usr/bin/env bash
# One GPU (`nvidia-h100-x1` / `nvidia-h200`), one call of the device tool (2026-11-26, third
# session), carry .whl: where the long-context and MoE decode time goes, before changing code.
# 1. the decode-attention kernel's launch settings at 32K and 128K keys, paged 16-row blocks
#    (issue 22: 128K decode at 62 % of its floor), and on the default model's shape at short
#    contexts (no regression there);
# 2. a prefill chunk's attention by SDPA backend (issue 22: 128K TTFT);
# 3. the MoE decode step's kernel table (issue 23: 38 % of its floor).
set -uo pipefail
source bench/device_env.sh
source bench/device_stages.sh
TAIL=80 run sweep8b 200 python3 bench/decode_attention_sweep.py --keys 32768,131072
TAIL=40 run sweepsmol 80 python3 bench/decode_attention_sweep.py --shapes smollm2-135m \
  --keys 512,4096 --per-sm 1,2,4 --block-n 64 --warps 4 --stages default,4
TAIL=40 run prefill_attn 60 python3 bench/prefill_attention.py
TAIL=70 run moe_profile 150 python3 bench/profile_decode.py --model random:qwen3-30b-a3b \
  --kv 256 --steps 30
log done
