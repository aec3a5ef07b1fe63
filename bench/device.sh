#!/usr/bin/env bash
# The bench runner for device machines: bash bench/device.sh STAGE...
# Runs the stages in order, from the repository root of a device machine, with the commands of
# bench/RESULTS.md's rows. Under $OUT: log.txt (what ran, the end of each output), rows.md (the
# RESULTS.md rows each stage printed) and runs.tgz (each run's whole log and JSON); the device
# tool brings back 8 files at most. bench/README.md says what to carry and how to call it.
#
#   tests     the GPU tests (pytest -m gpu; TESTS=paths, default tests, or part:N/M; on
#             TEST_WORKERS xdist workers, default 8, TEST_DIST their --dist, default
#             worksteal; failures as they happen in $OUT/failures.txt,
#             and every thread's stack of a test near its timeout in $OUT/failures.txt.stacks)
#   parity    bench/parity.py, then tests/gpu/test_parity.py (against transformers float32;
#             PARITY_ARGS: more arguments of `parity.py default`, FAMILIES: which families;
#             PARITY=default,families,tests,layers picks runs, default all but layers: layers
#             is bench/bf16_layers.py, ours and transformers' bfloat16 paired, each family's
#             layers, 24 prompts of 64 tokens, FAMILIES default llama,qwen3;
#             FAMILIES_LIMIT, FAMILIES_TOKENS: prompts and tokens of `parity.py families`;
#             PARITY_K: which of test_parity's cases, as pytest -k takes it, e.g. default)
#   llamacpp  llama.cpp built (.device-carry/lcp.tgz) and run on random-weight GGUFs of the
#             default model's and the Llama-8B shapes: the decode and prefill baselines
#   decode    batch-1 decode, 1 shard and 2 shards on one GPU, next to llama.cpp      (D1-D3)
#   prefill   a 3,900-token prompt, next to llama.cpp                                 (P1)
#   split     1 GPU against 2 (and 4) GPUs, the cuda-ipc hop; needs 2+ GPUs            (X1-X4)
#   spec      speculative decoding with the bundled draft, the real default model
#             (SPEC=greedy,gpus2,trees,sampled,streams,det; default greedy, and gpus2 on 2 GPUs;
#             SPEC=auto_greedy,auto_sampled,auto_streams: spec_policy auto against plain decoding,
#             1 shard and 2 shards on cuda:0, runtime/check_prompts.jsonl; SPEC=auto_declined: auto
#             and a policy that never speculates, greedy; SPEC=declined_long: that policy on
#             1,024-token answers; SPEC=presence_streams: 8 streams under auto, that policy, and
#             the draft loaded with nothing fed, S17); SPEC=auto_alternate: auto and declined
#             taking turns in one process, 5 rounds (no row); and the bench oracle
#             at published draft sizes, random chain weights (`shards.random_weights`: their
#             greedy tokens hold under any rounding) (SPEC=oracle8b,oracle8b_streams,oracle27b,
#             oracle27b_split: Qwen3-8B at acceptance 6.3, batch 1 and 8 streams, 1 shard;
#             Qwen3.5-27B at 8.3, 1 GPU and 2 shards)
#   cache     the prefix cache: repeats of 1K-32K prompts, prefix sharing, the host tier's swaps
#             (CACHE=prefix,shared,swap; default all)
#   hybrid    the Qwen3.5-27B shape: fused decode, 1 and 8 streams, prefill next to transformers
#             (.whl-tf), and on 2 GPUs the split and a 32K prefix saved on 2 GPUs restored into 1
#             (HYBRID=decode,streams,prefill,gpus2; default all)
#   moe       the Qwen3-30B-A3B shape: batch 1 next to its HBM floor, 8 and 32 streams
#             (MOE=profile: where a batch-1 step's time goes, four MoE shapes, kernel by kernel)
#   mla       the DeepSeek-V2-Lite-width MLA shape (deepseek_v3): parity against transformers
#             float32, batch 1 next to its HBM floor and 8 streams, the MLA decode kernel's test
#             and its attention to 32K keys (MLA=parity,speed,kernel; default all)
#   ab        D4: a switch's on against off, VAR=1 / 0 for each VAR of AB_VAR (comma-separated;
#             default LAYERSPLIT_PDL: programmatic dependent launch), processes in turn, twice
#             each: the DeepSeek-V2-Lite-width and Llama-8B shapes' batch 1, and for PDL
#             bench/pdl_chain.py's chains of kernels (AB_RUNS=chain,moe,dense,hybrid: hybrid
#             the Qwen3.5-27B shape's batch 1, ~8 minutes; default chain,moe,dense)
#   families  the gpt-oss-20b and GLM-4.5-Air shapes: parity against transformers float32 (4
#             layers), batch 1 next to the active-parameter floor and 8 streams (GLM: 16 layers)
#             (FAMILY_RUNS=parity,oss,glm; default all); FAMILY_DTYPE: ours in the parity runs
#             of `families` and `mla` (default bfloat16; float32: against float32, F1's floor)
#   long      the Qwen3-8B shape: a 128K prompt, 32K in chunks, one 64K conversation beside 15
#             short ones (LONG=128k,chunks,mixed,gpus2; default 128k)
#   serve     many streams (continuous batching), structured output, a soak of `layersplit
#             serve` (SERVE=streams,structured,soak; default streams,structured)
#   startup   `layersplit generate` from the command to the first token, empty caches then warm
#             (STARTUP=generate,shape,capture,hybrid,hybrid_bare; default generate; hybrid:
#             the Qwen3.5-27B shape's first start with fla-core's configs shipped for the GPU,
#             then without; hybrid_bare: with, LAYERSPLIT_FLA_BARE_IMPORT=1; hybrid_profile:
#             py-spy over the first, summed in $OUT/startup_hybrid_profile.md; hybrid_ab: T4 with
#             STARTUP_AB_VAR (default LAYERSPLIT_HYBRID_PREWARM) =1 then 0, twice; fla_import:
#             fla-core's import bare and whole, three times each, no row); generate_ab: T1 warm
#             with STARTUP_AB_VAR (default LAYERSPLIT_CUDA_CONTEXT_AHEAD) =1 and 0 in turn, 4
#             each, after one run that fills the caches; STARTUP=serve: the
#             first request after `layersplit serve` says ready, against the next ten, fresh
#             and after a restart restoring from disk (the default model, 2 shards)      (T6)
#   fla       fla-core's launch configs tuned on this GPU for the hybrid models' linear
#             attention (bench/fla_configs.py, FLA_HEADS), merged into shards/kernels/
#             fla_configs/<GPU>/ and brought back as $OUT/fla_configs.tgz (no row)
#   agent     a scripted 10-turn agent session against `layersplit serve` (the default model, 2
#             shards on cuda:0), restarted at turn 5, next to llama.cpp's server (llama-cpp-python,
#             where /tmp/lcpsite has llama_cpp and its server's packages)                  (A1)
#             and bench/kept_answers.py: the next turn's TTFT with an answer kept or not (A2);
#             AGENT_ARGS: more arguments of agent_session.py (e.g.
#             "--serve-arg=--keep-answers-delay-ms --serve-arg=50": keeps taken over)
#   quant     GGUF weights kept in their blocks: the quantized kernels' GPU tests and their
#             timings (bench/quant_gemv.py), the default model checked against transformers
#             float32 with weight_format quantized, and batch-1 decode quantized against
#             dequantized in one run, next to llama.cpp on the same file: the default model's
#             shape (Q4_1) and the Llama-8B shape as Q4_K_M; the Llama-8B shape kept in FP8
#             against bfloat16 (decode and TTFT in one row); the int4 GEMV's launch shapes;
#             P1's 3,900-token prefill, FP8 kept against bfloat16 (fp8_prefill)
#             (QUANT=tests,kernels,parity,smol,l8b,fp8,int4,fp8_prefill; default all);
#             QUANT=planar: the planar Q4_K / Q6_K GEMV's launch shapes, each projection's
#             best (not a row; PLANAR_TYPES=Q4_K or Q6_K: one of them);
#             QUANT=profile: where a Q4_K_M token's time goes (not a row): the Llama-8B
#             shape's decode step in one process under torch.profiler, kept Q4_K_M and
#             bfloat16, per step kernels, busy time, host gap and the costliest kernels; its
#             GEMVs as the step launches them; the runtime's own steps kept Q4_K_M
#             (LAYERSPLIT_KERNEL_PROFILE)
#   park      nothing: the call only parks the default model's piece it carries in /tmp
#
# Each run starts only if its estimate fits before DEADLINE (default 580 s into the call) and is
# cut there. Stages of one machine can share a call or come in back-to-back calls (the machine
# keeps /tmp while it is held: the model's pieces, llama.cpp's build).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n "2,/^set -uo/p" "$0" | sed "$ d"; exit 2; }
known=" tests parity llamacpp decode prefill split spec cache hybrid moe mla ab families long \
serve startup agent quant fla park "
for s in "$@"; do
  [[ "$known" == *" $s "* ]] || { echo "unknown stage $s (stages:$known)"; exit 2; }
done
source bench/device_env.sh
trap 'tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$RUNS"' EXIT  # (8 files come back)

has() { [[ ",$1," == *",$2,"* ]]; }  # has LIST ITEM
two_gpus() { [ "${GPUS:-0}" -ge 2 ] || { log "$1: needs 2 GPUs ($GPUS here)"; false; }; }
smol="bench/decode.py --model random:smollm2-135m-shape --prompt-len 512 --new-tokens 256 \
  --max-context 2048 --repeats 3"
l8b="bench/decode.py --model random:llama-8b-shape --prompt-len 512 --new-tokens 256 \
  --max-context 4096 --repeats 3"
spec="bench/speculative.py --model default --drafts default --sets unseen"
q8="bench/decode.py --model random:qwen3-8b --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
  --repeats 1 --max-context 33792 --prefill 32768"

stage_tests() {
  # (the whole GPU suite takes more than one call on an H200, even with 4 workers: TESTS picks
  # paths, or `part:N/M` the N-th of M parts of the files that hold GPU tests, every M-th of
  # them sorted)
  local paths=${TESTS:-tests}
  if [[ "$paths" =~ ^part:([0-9]+)/([0-9]+)$ ]]; then
    paths=$(grep -rl "pytest.mark.gpu" tests | sort |
      awk -v n="${BASH_REMATCH[1]}" -v m="${BASH_REMATCH[2]}" '(NR - 1) % m == n - 1' | xargs)
  fi
  # (TEST_WORKERS pytest-xdist workers share the GPU, 8 by default: a hung test's worker is
  # killed after 240 s and replaced; 0: one process, a hung test failed by a signal; each
  # failure lands in $OUT/failures.txt as it happens. Tests, not files, go to the workers
  # (TEST_DIST=worksteal: an idle worker takes half of a busy one's queue): file by file, the
  # hybrid's tests took 520 s in a row on one worker of 8 (the suite 537 s); a module's
  # fixtures are then made once per worker that runs its tests.)
  local workers=${TEST_WORKERS:-8} how=thread
  [ "$workers" = 0 ] && how=signal
  local cmd="$tests -n $workers --dist ${TEST_DIST:-worksteal} --timeout=240 --timeout-method=$how"
  # (test_parity's default-model cases need the model, joined from its three pieces; without
  # them they run in `parity`, on a later call, rather than fail here fetching it)
  local skip=()
  if ! default_model; then
    skip=(--deselect tests/gpu/test_parity.py::test_default_model_matches_transformers
          --deselect tests/gpu/test_parity.py::test_default_model_batched_and_restored
          --deselect tests/gpu/test_gguf_load_device.py::test_default_model_device_load_is_the_cpu_load)
    log "tests: the default model's cases (test_parity, test_gguf_load_device) left to the parity stage"
  fi
  TAIL=40 run tests 60 $cmd --durations=25 "${skip[@]}" $paths
  row pytest "$RUNS/tests.log" --what "GPU tests (${TESTS:-tests})" --cmd "$cmd ${skip[*]} $paths"
}

stage_parity() {  # (transformers from .whl-tf where it travelled: the image's may be older)
  local cases=${PARITY:-default,families,tests}
  local tf=()
  [ -d .whl-tf ] && install_tf && tf=(env "PYTHONPATH=$PYTHONPATH:/tmp/site-tf")
  # the default model in every layout (PARITY_LIMIT prompts), then each family's reduced shape
  if has "$cases" default && default_model; then
    TAIL=40 run parity_default 420 "${tf[@]}" python3 bench/parity.py default \
      --limit "${PARITY_LIMIT:-12}" --gpus "$(nvidia-smi -L | wc -l)" ${PARITY_ARGS:-} \
      --out "$OUT/parity_default.json"
  fi
  if has "$cases" families; then
    TAIL=40 run parity_families 420 "${tf[@]}" python3 bench/parity.py families \
      --limit "${FAMILIES_LIMIT:-6}" --new-tokens "${FAMILIES_TOKENS:-48}" \
      ${FAMILIES:+--families "$FAMILIES"} --out "$OUT/parity_families.json"
  fi
  if has "$cases" tests; then
    default_model  # (its cases error without it: they would fetch it from the registry)
    # (one xdist worker with pytest-timeout's thread method: a hung case dumps every thread's
    # stack into the log, its worker is replaced, and the cases after it still run)
    TAIL=60 run parity_tests 250 "${tf[@]}" $tests -n 1 --timeout=200 --timeout-method=thread \
      ${PARITY_K:+-k "$PARITY_K"} tests/gpu/test_parity.py tests/gpu/test_gguf_load_device.py
    row pytest "$RUNS/parity_tests.log" --what "tests/gpu/test_parity.py, test_gguf_load_device.py" \
      --cmd parity
  fi
  if has "$cases" layers; then
    local fam
    for fam in $(echo "${FAMILIES:-llama,qwen3}" | tr , ' '); do
      TAIL=120 run "bf16_layers_$fam" 200 "${tf[@]}" python3 bench/bf16_layers.py \
        --family "$fam" --device cuda:0 --limit 24 --new-tokens 64 \
        --out "$RUNS/bf16_layers_$fam.json"
    done
  fi
}

kept_vs_bf16() {  # NAME SHAPE WHAT KEY: random:SHAPE's batch-1 decode kept quantized, and the
  # Llama-8B shape's in bfloat16 beside it (once a call), as RESULTS.md rows under KEY
  TAIL=10 run "quant_$1" 200 python3 $l8b --model "random:$2" --layouts cuda:0 \
    --weight-format quantized --floor --json "$RUNS/quant_$1.json"
  [ -e "$RUNS/quant_bf16.json" ] || TAIL=10 run quant_bf16 150 python3 $l8b --layouts cuda:0 \
    --floor --json "$RUNS/quant_bf16.json"
  local b=()  # (bfloat16's decode and TTFT in the row, where its run ended)
  [ -e "$RUNS/quant_bf16.json" ] && b=(--baseline "$RUNS/quant_bf16.json")
  row decode "$RUNS/quant_$1.json" "${b[@]}" --what "$3" --cmd "$4"
  row decode "$RUNS/quant_bf16.json" --what "bfloat16, the same shape" --cmd "$4"
}

quant_profile() {  # (QUANT=profile: diagnostics, no rows; about 4 minutes on an H200)
  local prof="bench/profile_decode.py --kv 512 --steps 50 --profile-steps 32 --top 15"
  TAIL=20 run quant_prof_q4km 150 python3 $prof --model /tmp/llama8b-q4km.gguf \
    --weight-format quantized --json "$RUNS/quant_prof_q4km.json"
  TAIL=20 run quant_prof_bf16 90 python3 $prof --model random:llama-8b-shape \
    --json "$RUNS/quant_prof_bf16.json"
  TAIL=40 run quant_prof_gemv 60 python3 bench/quant_gemv.py --types Q4_K,Q6_K --rows 1 \
    --repeats 10 --json "$RUNS/quant_prof_gemv.json"
  # the runtime's steps 161-192 (the timed run's decode; its tok/s counts the profiled steps)
  local kp=/tmp/kprof_q4km
  rm -rf "$kp"
  TAIL=10 run quant_prof_runtime 120 env LAYERSPLIT_KERNEL_PROFILE="$kp:160:32" python3 \
    bench/decode.py --model /tmp/llama8b-q4km.gguf --layouts cuda:0 --prompt-len 512 \
    --new-tokens 128 --max-context 2048 --repeats 1 --weight-format quantized \
    --json "$RUNS/quant_prof_runtime.json"
  [ -d "$kp" ] && TAIL=40 run quant_prof_summary 30 python3 bench/kernel_summary.py "$kp" \
    --steps 32 --top 15 --json "$RUNS/quant_prof_summary.json"
}

stage_quant() {  # Q1-Q10
  local cases=${QUANT:-tests,kernels,parity,smol,l8b,fp8,int4,fp8_prefill}
  if has "$cases" tests; then
    TAIL=20 run quant_tests 200 $tests tests/gpu/test_quant_gemv.py tests/gpu/test_fp8_gemv.py \
      tests/gpu/test_int4_gemv.py tests/gpu/test_dequant.py
    row pytest "$RUNS/quant_tests.log" --what "tests/gpu/test_quant_gemv.py, test_fp8_gemv.py, \
test_int4_gemv.py, test_dequant.py" --cmd quant
  fi
  if has "$cases" int4; then  # (GPTQ / AWQ kept in int4, group 128: the GEMV against float16,
    # then Q8: the Llama-8B shape's random values rounded to int4, against its bfloat16 run)
    TAIL=250 run quant_int4_sweep 240 python3 bench/quant_gemv.py --sweep --types INT4 \
      --rows 1 --repeats 10 --json "$RUNS/quant_int4_sweep.json"
    kept_vs_bf16 int4 llama-8b-int4 "GPTQ int4 kept (group 128)" Q8
  fi
  if has "$cases" planar; then  # (the planar K-quant GEMV's launch shapes, for tuning)
    # (PLANAR_TYPES=Q4_K, then =Q6_K: one type a call, where both do not fit one)
    TAIL=60 run quant_planar_sweep 540 python3 bench/quant_gemv.py --sweep --best \
      --types "${PLANAR_TYPES:-Q4_K,Q6_K}" --rows 1 --repeats 10 \
      --json "$RUNS/quant_planar_sweep.json"
  fi
  if has "$cases" fp8; then  # (Q6: random values; the bfloat16 shape's run beside it)
    kept_vs_bf16 fp8 llama-8b-fp8 "FP8 kept (block 128)" Q6
  fi
  if has "$cases" fp8_prefill; then  # (Q10: P1's 3,900-token prefill, FP8 kept and bfloat16)
    local pf="bench/decode.py --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
      --max-context 8192 --repeats 3 --prefill 3900 --prefill-chunk 2048"
    TAIL=8 run quant_fp8_prefill 200 python3 $pf --model random:llama-8b-fp8 \
      --weight-format quantized --json "$RUNS/quant_fp8_prefill.json"
    TAIL=8 run quant_bf16_prefill 150 python3 $pf --model random:llama-8b-shape \
      --json "$RUNS/quant_bf16_prefill.json"
    local b=()
    [ -e "$RUNS/quant_bf16_prefill.json" ] && b=(--baseline "$RUNS/quant_bf16_prefill.json")
    row prefill "$RUNS/quant_fp8_prefill.json" "${b[@]}" --what "FP8 kept (block 128)" --cmd Q10
  fi
  if has "$cases" kernels; then
    TAIL=100 run quant_kernels 200 python3 bench/quant_gemv.py --json "$RUNS/quant_kernels.json"
    TAIL=200 run quant_fp8_sweep 120 python3 bench/quant_gemv.py --sweep --types FP8 --rows 1 \
      --repeats 10 --json "$RUNS/quant_fp8_sweep.json"  # (Q7)
  fi
  if has "$cases" parity && default_model; then
    local tf=()
    [ -d .whl-tf ] && install_tf && tf=(env "PYTHONPATH=$PYTHONPATH:/tmp/site-tf")
    TAIL=30 run quant_parity 300 "${tf[@]}" python3 -m layersplit.launch.cli check \
      --model default --devices cuda:0 --weight-format quantized --limit "${PARITY_LIMIT:-12}"
  fi
  # (our own copy of llama.cpp's /tmp/smol-q4_1.gguf, which its background build may be
  # writing now: the same seed, the same bytes)
  local smol=/tmp/quant-smol-q4_1.gguf
  if has "$cases" smol && random_gguf smollm2-135m-shape q4_1 $smol; then
    TAIL=10 run quant_smol 200 python3 bench/decode.py --model $smol \
      --layouts cuda:0 --prompt-len 512 --new-tokens 256 --max-context 2048 --repeats 3 \
      --weight-format quantized --floor --json "$RUNS/quant_smol.json"
    TAIL=10 run quant_smol_deq 120 python3 bench/decode.py --model $smol \
      --layouts cuda:0 --prompt-len 512 --new-tokens 256 --max-context 2048 --repeats 3 \
      --weight-format dequantize --json "$RUNS/quant_smol_deq.json"
  fi
  if has "$cases" l8b && random_gguf llama-8b-shape q4_k_m /tmp/llama8b-q4km.gguf; then
    TAIL=10 run quant_l8b 240 python3 bench/decode.py --model /tmp/llama8b-q4km.gguf \
      --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 2048 --repeats 3 \
      --weight-format quantized --floor --json "$RUNS/quant_l8b.json"
    TAIL=10 run quant_l8b_deq 300 python3 bench/decode.py --model /tmp/llama8b-q4km.gguf \
      --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 2048 --repeats 3 \
      --weight-format dequantize --json "$RUNS/quant_l8b_deq.json"
  fi
  if { has "$cases" smol || has "$cases" l8b; } && lcp_wait 120; then
    has "$cases" smol && lcp smol /tmp/smol-q4_1.gguf
    has "$cases" l8b && [ -s /tmp/llama8b-q4km.gguf ] && lcp l8bq4km /tmp/llama8b-q4km.gguf
  fi
  if has "$cases" profile && random_gguf llama-8b-shape q4_k_m /tmp/llama8b-q4km.gguf; then
    quant_profile
  fi
  local s=() l=()
  [ -e "$RUNS/lcp_smol.json" ] && s=(--llamacpp "$RUNS/lcp_smol.json")
  [ -e "$RUNS/lcp_l8bq4km.json" ] && l=(--llamacpp "$RUNS/lcp_l8bq4km.json")
  row decode "$RUNS/quant_smol.json" "${s[@]}" --what "Q4_1 kept quantized" --cmd Q3
  row decode "$RUNS/quant_smol_deq.json" --what "Q4_1 dequantized" --cmd Q3
  row decode "$RUNS/quant_l8b.json" "${l[@]}" --what "Q4_K_M kept quantized" --cmd Q4
  row decode "$RUNS/quant_l8b_deq.json" --what "Q4_K_M dequantized" --cmd Q4
}

stage_llamacpp() {
  lcp_start
  lcp_wait 100 || return 1
  lcp smol /tmp/smol-q4_1.gguf
  lcp l8b /tmp/llama8b-f16.gguf
  row llamacpp "$RUNS/lcp_smol.json" --cmd D1
  row llamacpp "$RUNS/lcp_l8b.json" --cmd D2
}

stage_decode() {  # D1, D2, D3; llama.cpp's runs in the same call when its build is there
  TAIL=8 run decode_smol 120 python3 $smol --layouts cuda:0 cuda:0,cuda:0 \
    --json "$RUNS/decode_smol.json"
  TAIL=8 run decode_l8b 110 python3 $l8b --layouts cuda:0 --floor --json "$RUNS/decode_l8b.json"
  TAIL=8 run decode_smol_ahead_off 70 python3 $smol --layouts cuda:0,cuda:0 --decode-ahead off \
    --json "$RUNS/decode_smol_ahead_off.json"
  if [ -e /tmp/lcp.pid ] && lcp_wait 110; then
    lcp smol /tmp/smol-q4_1.gguf
    lcp l8b /tmp/llama8b-f16.gguf
  fi
  local s=() l=()
  [ -e "$RUNS/lcp_smol.json" ] && s=(--llamacpp "$RUNS/lcp_smol.json")
  [ -e "$RUNS/lcp_l8b.json" ] && l=(--llamacpp "$RUNS/lcp_l8b.json")
  row decode "$RUNS/decode_smol.json" "${s[@]}" --cmd D1
  row decode "$RUNS/decode_l8b.json" "${l[@]}" --cmd D2
  row decode "$RUNS/decode_smol_ahead_off.json" --what "decode_ahead off" --cmd D3
}

stage_prefill() {  # P1; llama.cpp's prefill from this call's (or an earlier call's) run
  for m in smol l8b; do
    local model=smollm2-135m-shape
    [ $m = l8b ] && model=llama-8b-shape
    TAIL=8 run "prefill_$m" 100 python3 bench/decode.py --model "random:$model" --layouts cuda:0 \
      --prompt-len 512 --new-tokens 16 --max-context 8192 --repeats 3 --prefill 3900 \
      --prefill-chunk 2048 --json "$RUNS/prefill_$m.json"
  done
  # the host cost of a few-row eager prefill step, call by call (its log only: no row)
  TAIL=40 run prefill_host 60 python3 bench/prefill_host.py --device cuda:0 --dtype float16 \
    --model random:smollm2-135m-shape --layers 15 --calls --profile
  if [ -e /tmp/lcp.done ] && [ ! -e "$RUNS/lcp_smol.json" ]; then
    lcp smol /tmp/smol-q4_1.gguf
    lcp l8b /tmp/llama8b-f16.gguf
  fi
  for m in smol l8b; do
    local b=()
    [ -e "/tmp/lcp_$m.json" ] && b=(--llamacpp "/tmp/lcp_$m.json")
    row prefill "$RUNS/prefill_$m.json" "${b[@]}" --cmd P1
  done
}

stage_split() {  # X1 (three shapes), X2 (the hop, and its host share), X3 and X4 (4 GPUs)
  two_gpus split || return 1
  for m in smollm2-135m-shape qwen3-8b llama-8b-shape; do
    local ctx=4096
    [ $m = smollm2-135m-shape ] && ctx=2048
    TAIL=8 run "split_$m" 110 python3 bench/decode.py --model "random:$m" --layouts cuda:0 \
      cuda:0,cuda:1 --prompt-len 512 --new-tokens 256 --max-context $ctx --repeats 3 \
      --json "$RUNS/split_$m.json"
    row split "$RUNS/split_$m.json" --cmd X1
  done
  TAIL=10 run hop 60 bash -c 'for i in 1 2 3 4 5; do python3 bench/hop_latency.py \
    --devices cuda:0,cuda:1 --transports cuda-ipc --tokens 1 --hidden 4096 --iters 1000 \
    --json "$0/hop_$i.json" | tail -2; done' "$RUNS"
  row hop "$RUNS"/hop_[1-5].json --cmd X2
  # the same hop without IPC events (host waits instead) and through host memory, one run each:
  # where the hop's time goes
  TAIL=6 run hop_kinds 60 python3 bench/hop_latency.py --devices cuda:0,cuda:1 \
    --transports cuda-ipc,cuda-ipc-sync,shm --tokens 1 --hidden 4096 --iters 1000
  # the host's share of a hop on this machine (send, and the receiver's take; no peer)
  TAIL=5 run hop_host 30 python3 bench/hop_latency.py --in-process --transports shm,zmq-ipc \
    --tokens 1 --hidden 4096 --iters 20000
  TAIL=16 run hop_units 30 python3 bench/cuda_unit_costs.py
  if [ "$GPUS" -ge 4 ]; then
    TAIL=12 run split4_decode 200 python3 bench/split4.py --part decode --json "$RUNS/split4.json"
    TAIL=12 run split4_cache 200 python3 bench/split4.py --part cache --cache-parent /tmp
  fi
}

stage_spec() {  # S1-S6, S12-S14: the real default model and its bundled draft; S8-S11 the oracle
  local cases=${SPEC:-greedy}
  [[ ",$cases" =~ ,[^o] ]] && { default_model || return 1; }  # (all but oracle* read it)
  [ -z "${SPEC:-}" ] && [ "$GPUS" -ge 2 ] && cases=greedy,gpus2
  local one="--devices cuda:0,cuda:0"
  if has "$cases" greedy; then
    TAIL=12 run spec_greedy 180 python3 $spec $one --new-tokens 256 --repeat 3 \
      --json "$RUNS/spec_greedy.json"
    row spec "$RUNS/spec_greedy.json" --what "greedy, 2 shards on one GPU" --cmd S1
  fi
  if has "$cases" gpus2 && two_gpus "spec gpus2"; then
    TAIL=12 run spec_gpus2 180 python3 $spec --devices cuda:0,cuda:1 --new-tokens 256 \
      --repeat 3 --json "$RUNS/spec_gpus2.json"
    row spec "$RUNS/spec_gpus2.json" --what "greedy, 2 shards on 2 GPUs" --cmd S2
  fi
  if has "$cases" trees; then
    TAIL=14 run spec_trees 300 python3 $spec $one --new-tokens 256 --repeat 3 --trees 31,15,7 \
      --json "$RUNS/spec_trees.json"
    row spec "$RUNS/spec_trees.json" --what "greedy" --labels "tree of 31,tree of 15,tree of 7" \
      --cmd S3
  fi
  if has "$cases" sampled; then
    TAIL=12 run spec_sampled 220 python3 $spec $one --new-tokens 128 --repeat 3 \
      --temperature 0.7 --top-p 0.9 --sampling coupled --json "$RUNS/spec_sampled.json"
    row spec "$RUNS/spec_sampled.json" --what "temperature 0.7, top-p 0.9, coupled" --cmd S4
  fi
  if has "$cases" streams; then
    TAIL=12 run spec_streams 220 python3 $spec $one --streams 8 --ignore-eos --new-tokens 128 \
      --repeat 3 --json "$RUNS/spec_streams.json"
    row spec "$RUNS/spec_streams.json" --what "8 streams each speculating" --cmd S5
  fi
  # spec_policy auto (the runtime's default) against plain decoding, in one run: 1 shard (the
  # default layout of `generate --devices cuda:0`) and 2 shards on one GPU; 24 of the 56 prompts
  # of runtime/check_prompts.jsonl, 128 new tokens, median of 3
  local auto="--sets check --limit 24 --new-tokens 128 --repeat 3 --policies auto" layout n
  for layout in cuda:0 cuda:0,cuda:0; do
    n=$(( $(tr -cd , <<< "$layout" | wc -c) + 1 ))
    if has "$cases" auto_greedy; then
      TAIL=12 run spec_auto_greedy_$n 200 python3 $spec --devices $layout $auto \
        --json "$RUNS/spec_auto_greedy_$n.json"
      row spec "$RUNS/spec_auto_greedy_$n.json" \
        --what "spec_policy auto, greedy, $n shard(s) on one GPU" --cmd "S12 ($layout)"
    fi
    if has "$cases" auto_declined; then  # (auto, and a policy that never speculates: what a
      # plain step costs with the draft loaded, against plain decoding without it, same run)
      TAIL=12 run spec_auto_declined_$n 300 python3 $spec --devices $layout $auto,declined \
        --json "$RUNS/spec_auto_declined_$n.json"
      row spec "$RUNS/spec_auto_declined_$n.json" --labels "spec_policy auto,a policy that \
never speculates (declined)" --what "greedy, $n shard(s) on one GPU" --cmd "S15 ($layout)"
    fi
    if has "$cases" declined_long; then  # (the same, 1,024-token answers: a parked step's cost
      # must not grow with the rows parked before it)
      TAIL=12 run spec_declined_long_$n 300 python3 $spec --devices $layout --sets check \
        --limit 8 --new-tokens 1024 --ignore-eos --repeat 3 --policies declined \
        --json "$RUNS/spec_declined_long_$n.json"
      row spec "$RUNS/spec_declined_long_$n.json" --labels "a policy that never speculates \
(declined)" --what "greedy, 1,024 tokens, $n shard(s) on one GPU" --cmd "S16 ($layout)"
    fi
    if has "$cases" auto_sampled; then
      TAIL=12 run spec_auto_sampled_$n 200 python3 $spec --devices $layout $auto \
        --temperature 0.7 --top-p 0.9 --json "$RUNS/spec_auto_sampled_$n.json"
      row spec "$RUNS/spec_auto_sampled_$n.json" \
        --what "spec_policy auto, temperature 0.7, top-p 0.9, $n shard(s) on one GPU" \
        --cmd "S13 ($layout)"
    fi
    if has "$cases" presence_streams; then  # (8 streams: auto, a policy that never speculates,
      # and the draft loaded with no sequence feeding it (idle): what its process alone costs)
      TAIL=20 run spec_presence_streams_$n 280 python3 $spec --devices $layout $auto,declined,idle \
        --streams 8 --ignore-eos --json "$RUNS/spec_presence_streams_$n.json"
      row spec "$RUNS/spec_presence_streams_$n.json" --labels "spec_policy auto,declined,idle \
(the draft loaded, nothing fed)" --what "8 streams, $n shard(s) on one GPU" --cmd "S17 ($layout)"
    fi
    if has "$cases" auto_alternate; then  # (auto and declined taking turns in one process, 5
      # rounds: the policy's ratio without the spread between processes; no row, its log)
      TAIL=16 run spec_auto_alternate_$n 300 python3 $spec --devices $layout --sets check \
        --limit 24 --new-tokens 128 --repeat 5 --alternate auto,declined \
        --json "$RUNS/spec_auto_alternate_$n.json"
    fi
    if has "$cases" auto_streams; then
      TAIL=14 run spec_auto_streams_$n 200 python3 $spec --devices $layout $auto --streams 8 \
        --ignore-eos --json "$RUNS/spec_auto_streams_$n.json"
      row spec "$RUNS/spec_auto_streams_$n.json" \
        --what "spec_policy auto, 8 streams, $n shard(s) on one GPU" --cmd "S14 ($layout)"
    fi
  done
  # the bench oracle (`draft.oracle`): --new-tokens end the requests on its lattice (seed 1:
  # 1 + 252 at 6.3, 1 + 249 at 8.3), so the measured acceptance is A
  local o8="bench/speculative.py --model random:qwen3-8b-chain --drafts random:qwen3-8b-dflash-b16 \
    --oracle-acceptance 6.3 --new-tokens 253 --ignore-eos --repeat 3 --max-context 1024"
  local o27="bench/speculative.py --model random:qwen3.5-27b-chain --drafts random:qwen3.5-27b-dflash \
    --oracle-acceptance 8.3 --new-tokens 250 --ignore-eos --repeat 3 --max-context 1024 --limit 4"
  if has "$cases" oracle8b; then
    TAIL=20 run spec_oracle8b 420 python3 $o8 --devices cuda:0 --limit 6 \
      --json "$RUNS/spec_oracle8b.json"
    row spec "$RUNS/spec_oracle8b.json" --what "bench oracle, Qwen3-8B shape, A 6.3, 1 shard" \
      --cmd S8
  fi
  if has "$cases" oracle8b_streams; then
    TAIL=20 run spec_oracle8b_streams 420 python3 $o8 --devices cuda:0 --limit 8 --streams 8 \
      --json "$RUNS/spec_oracle8b_streams.json"
    row spec "$RUNS/spec_oracle8b_streams.json" --what "bench oracle, Qwen3-8B shape, A 6.3, \
8 streams, 1 shard" --cmd S9
  fi
  if has "$cases" oracle27b; then
    TAIL=20 run spec_oracle27b 420 python3 $o27 --devices cuda:0 \
      --json "$RUNS/spec_oracle27b.json"
    row spec "$RUNS/spec_oracle27b.json" --what "bench oracle, Qwen3.5-27B shape, A 8.3, 1 GPU" \
      --cmd S10
  fi
  if has "$cases" oracle27b_split; then  # 2 GPUs where there are 2, else 2 shards on one
    local two=cuda:0,cuda:0
    [ "$GPUS" -ge 2 ] && two=cuda:0,cuda:1
    TAIL=20 run spec_oracle27b_split 480 python3 $o27 --devices $two \
      --json "$RUNS/spec_oracle27b_split.json"
    row spec "$RUNS/spec_oracle27b_split.json" --what "bench oracle, Qwen3.5-27B shape, A 8.3, \
2 shards ($two)" --cmd S11
  fi
  if has "$cases" det; then  # (the held-out prompts, chains of 4 rows)
    TAIL=20 run spec_det 500 python3 bench/speculative.py --model default $one --drafts default \
      --new-tokens 128 --repeat 3 --deterministic --sets eval --limit 12 --trees 0 --block 4 \
      --json "$RUNS/spec_det.json"
    row spec "$RUNS/spec_det.json" --what "deterministic mode" --labels "chains of 4" --cmd S6
  fi
}

stage_cache() {  # C1 (on 2 GPUs where there are two), C3, C4
  local cases=${CACHE:-prefix,shared,swap} devices=cuda:0
  [ "$GPUS" -ge 2 ] && devices=cuda:0,cuda:1
  if has "$cases" prefix; then
    TAIL=10 run cache_prefix 300 python3 bench/prefix_cache.py --model random:qwen3-8b \
      --devices $devices --lengths 1024,8192,32768 --prefill-chunk 2048 --dir /tmp/pc8b \
      --json "$RUNS/cache_prefix.json"
    row cache "$RUNS/cache_prefix.json" --what "Qwen3-8B shape, $devices" --cmd C1
  fi
  if has "$cases" swap; then
    TAIL=8 run cache_swap 120 python3 bench/kv_swap.py --tokens 8192,32768 --repeats 3 &&
      echo "| host tier's swaps, 32,768 tokens (out returns / done, in returns / done) | \
$(grep -E '^ *32768' "$RUNS/cache_swap.log" | tr -s ' ' | head -1) | (in the same line: the \
synchronous copy) | $RESULTS_DEVICE | $RESULTS_DATE | $RESULTS_COMMIT | C6 |" | tee -a "$ROWS"
  fi
  if has "$cases" shared; then
    TAIL=8 run cache_shared 400 python3 bench/shared_prefix.py --model random:qwen3-8b \
      --devices cuda:0 --prefix 30720 --requests 8 --kv-cache-gb 24 &&
      echo "| 8 requests on one 30,720-token prefix | $(grep -m1 'KV blocks held' \
        "$RUNS/cache_shared.log" | cut -c3-) | (in the same line: as separate copies) | \
$RESULTS_DEVICE | $RESULTS_DATE | $RESULTS_COMMIT | C5 |" | tee -a "$ROWS"
  fi
}

stage_hybrid() {  # H1-H5
  local cases=${HYBRID:-decode,streams,prefill,gpus2} m=random:qwen3.5-27b
  if has "$cases" decode; then
    TAIL=10 run hybrid_fused 230 python3 bench/decode.py --model $m --layouts cuda:0 \
      cuda:0,cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor \
      --json "$RUNS/hybrid_fused.json"
    TAIL=10 run hybrid_unfused 130 env LAYERSPLIT_FUSED_HYBRID=0 python3 bench/decode.py \
      --model $m --layouts cuda:0 --prompt-len 512 --new-tokens 128 --max-context 4096 \
      --repeats 3 --floor --json "$RUNS/hybrid_unfused.json"
    row decode "$RUNS/hybrid_fused.json" --cmd H1
    row decode "$RUNS/hybrid_unfused.json" --what "unfused (LAYERSPLIT_FUSED_HYBRID=0)" --cmd H1
  fi
  if has "$cases" streams; then  # (batched decode: one graph a step for every sequence)
    TAIL=12 run hybrid_streams 300 python3 bench/concurrency.py --model $m --layouts cuda:0 \
      --streams 1,8 --prompt-len 512 --new-tokens 128 --repeats 3 \
      --json "$RUNS/hybrid_streams.json"
    row concurrency "$RUNS/hybrid_streams.json" --what "Qwen3.5-27B shape" --cmd H5
  fi
  if has "$cases" prefill && install_tf; then
    TAIL=10 run hybrid_prefill 300 env PYTHONPATH=$PYTHONPATH:/tmp/site-tf python3 \
      bench/decode.py --model $m --layouts cuda:0 --prompt-len 512 --new-tokens 16 \
      --max-context 40960 --repeats 1 --prefill 8192,32768 --prefill-chunk 8192 \
      --kv-cache-gb 4 --hf --json "$RUNS/hybrid_prefill.json"
    row prefill "$RUNS/hybrid_prefill.json" --cmd H2
  fi
  if has "$cases" gpus2 && two_gpus "hybrid gpus2"; then
    TAIL=10 run hybrid_gpus2 240 python3 bench/decode.py --model $m --layouts cuda:0 \
      cuda:0,cuda:1 --prompt-len 512 --new-tokens 128 --max-context 4096 --repeats 3 --floor \
      --json "$RUNS/hybrid_gpus2.json"
    row split "$RUNS/hybrid_gpus2.json" --cmd H3
    TAIL=10 run hybrid_xsplit 200 python3 bench/prefix_cache.py --model $m \
      --devices cuda:0,cuda:1 --restore-devices cuda:0 --lengths 32768 --prefill-chunk 2048 \
      --check-tokens 16 --dir /tmp/pc27 --json "$RUNS/hybrid_xsplit.json"
    row cache "$RUNS/hybrid_xsplit.json" --what "Qwen3.5-27B shape, saved on 2 GPUs, restored \
into 1" --cmd H4
  fi
}

stage_moe() {  # M1 (and M2 on 2 GPUs); MOE=profile: where a batch-1 step's time goes, per family
  if [ "${MOE:-}" = profile ]; then  # (bench/profile_decode.py's kernel table, no rows)
    local m
    for m in qwen3-30b-a3b deepseek-v2-lite-shape gpt-oss-20b "glm-4.5-air --layers 16"; do
      TAIL=45 run "moe_profile_${m%% *}" 150 python3 bench/profile_decode.py --model random:$m \
        --kv 256 --steps 30 --top 30 --json "$RUNS/moe_profile_${m%% *}.json"
    done
    return
  fi
  TAIL=12 run moe 330 python3 bench/moe.py --layouts cuda:0 cuda:0,cuda:0 --streams 8,32 \
    --repeats 3 --json "$RUNS/moe.json"
  row moe "$RUNS/moe.json" --cmd M1
  if [ "$GPUS" -ge 2 ]; then
    TAIL=12 run moe_gpus2 200 python3 bench/moe.py --layouts cuda:0 cuda:0,cuda:1 --streams 8 \
      --repeats 3 --json "$RUNS/moe_gpus2.json"
    row moe "$RUNS/moe_gpus2.json" --cmd M2
  fi
}

stage_mla() {  # M4; MLA=parity,speed,kernel (default all: more than one call's 580 s)
  local cases=${MLA:-parity,speed,kernel} tf=()
  if has "$cases" parity; then
    [ -d .whl-tf ] && install_tf && tf=(env "PYTHONPATH=$PYTHONPATH:/tmp/site-tf")
    TAIL=40 run mla_parity 420 "${tf[@]}" python3 bench/parity.py families \
      --families deepseek_v3 --limit 6 --new-tokens 48 --dtype "${FAMILY_DTYPE:-bfloat16}" \
      --out "$OUT/parity_mla.json"
  fi
  if has "$cases" speed; then
    TAIL=12 run mla 330 python3 bench/moe.py --shape deepseek-v2-lite \
      --layouts cuda:0 cuda:0,cuda:0 --streams 8 --repeats 3 --json "$RUNS/mla.json"
    row moe "$RUNS/mla.json" --cmd M4
  fi
  if has "$cases" kernel; then
    TAIL=20 run mla_kernel 150 $tests tests/gpu/test_mla_kernel.py
    row pytest "$RUNS/mla_kernel.log" --what "tests/gpu/test_mla_kernel.py" --cmd mla
    TAIL=12 run mla_attention 150 python3 bench/mla_attention.py --keys 256,2048,8192,32768 \
      --json "$RUNS/mla_attention.json"
  fi
}

stage_ab() {  # D4 (AB_VAR: switches, comma-separated, default LAYERSPLIT_PDL; AB_RUNS)
  local vars=${AB_VAR:-LAYERSPLIT_PDL} runs=${AB_RUNS:-chain,moe,dense} var i p
  for var in ${vars//,/ }; do
    if has "$runs" chain && [ "$var" = LAYERSPLIT_PDL ]; then
      TAIL=12 run pdl_chain 90 python3 bench/pdl_chain.py --json "$RUNS/pdl_chain.json"
    fi
    for i in 1 2; do
      for p in 0 1; do
        if has "$runs" moe; then
          TAIL=6 run "moe_${var}_ab${p}_$i" 40 env "$var=$p" python3 bench/moe.py \
            --shape deepseek-v2-lite --layouts cuda:0 --streams 8 --repeats 3 \
            --json "$RUNS/moe_${var}_ab${p}_$i.json"
        fi
        if has "$runs" dense; then
          TAIL=6 run "l8b_${var}_ab${p}_$i" 60 env "$var=$p" python3 $l8b --layouts cuda:0 \
            --json "$RUNS/l8b_${var}_ab${p}_$i.json"
        fi
        if has "$runs" hybrid; then  # (the Qwen3.5-27B shape, one process)
          TAIL=6 run "h27_${var}_ab${p}_$i" 120 env "$var=$p" python3 bench/decode.py \
            --model random:qwen3.5-27b --layouts cuda:0 --prompt-len 512 --new-tokens 128 \
            --max-context 4096 --repeats 3 --floor --json "$RUNS/h27_${var}_ab${p}_$i.json"
        fi
      done
    done
    has "$runs" moe && row ab "$RUNS"/moe_"${var}"_ab*.json --what "$var" --cmd D4
    has "$runs" dense && row ab "$RUNS"/l8b_"${var}"_ab*.json --what "$var" --cmd D4
    has "$runs" hybrid && row ab "$RUNS"/h27_"${var}"_ab*.json --what "$var" --cmd D4
  done
}

stage_families() {  # F1-F3 (parity against transformers float32, then decode speed)
  local runs=${FAMILY_RUNS:-parity,oss,glm} tf=()
  if has "$runs" parity; then
    [ -d .whl-tf ] && install_tf && tf=(env "PYTHONPATH=$PYTHONPATH:/tmp/site-tf")
    TAIL=40 run parity_new_families 300 "${tf[@]}" python3 bench/parity.py families \
      --families gpt_oss,glm4_moe --limit 6 --new-tokens 48 --dtype "${FAMILY_DTYPE:-bfloat16}" \
      --out "$OUT/parity_new_families.json"
  fi
  if has "$runs" oss; then
    TAIL=12 run moe_gpt_oss 200 python3 bench/moe.py --shape gpt-oss-20b --layouts cuda:0 \
      --streams 8 --repeats 3 --json "$RUNS/moe_gpt_oss.json"
    row moe "$RUNS/moe_gpt_oss.json" --cmd F2
  fi
  if has "$runs" glm; then
    TAIL=12 run moe_glm_air 250 python3 bench/moe.py --shape glm-4.5-air --layers 16 \
      --layouts cuda:0 --streams 8 --repeats 3 --json "$RUNS/moe_glm_air.json"
    row moe "$RUNS/moe_glm_air.json" --cmd F3
  fi
}

stage_long() {  # L1-L4
  local cases=${LONG:-128k}
  if has "$cases" 128k; then
    TAIL=10 run long_128k 300 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
      --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
      --prefill-chunk 8192 --repeats 3 --floor --json "$RUNS/long_128k.json"
    row decode "$RUNS/long_128k.json" --what "after a 131,072-token prompt" --cmd L1
  fi
  if has "$cases" chunks; then
    TAIL=6 run long_chunk2048 100 python3 $q8 --prefill-chunk 2048 --json "$RUNS/long_chunk2048.json"
    TAIL=6 run long_chunk32k 80 python3 $q8 --prefill-chunk 32768 --json "$RUNS/long_chunk32k.json"
    row prefill "$RUNS/long_chunk2048.json" --what "chunks of 2048" --cmd L2
    row prefill "$RUNS/long_chunk32k.json" --what "one piece" --cmd L2
  fi
  if has "$cases" mixed; then
    TAIL=12 run long_mixed 400 python3 bench/concurrency.py --model random:qwen3-8b \
      --layouts cuda:0 --mixed 65536x1,2048x15 --prompt-len 2048 --new-tokens 128 \
      --kv-cache-gb 24 --prefill-chunk 2048 --repeats 3 --json "$RUNS/long_mixed.json"
    row concurrency "$RUNS/long_mixed.json" --what "Qwen3-8B shape" --cmd L3
  fi
  if has "$cases" gpus2 && two_gpus "long gpus2"; then
    TAIL=10 run long_gpus2 200 python3 bench/decode.py --model random:qwen3-8b --layouts cuda:0 \
      cuda:0,cuda:1 --prompt-len 131072 --new-tokens 64 --max-context 131200 --kv-cache-gb 24 \
      --prefill-chunk 8192 --repeats 1 --json "$RUNS/long_gpus2.json"
    row split "$RUNS/long_gpus2.json" --cmd L4
    TAIL=10 run long_cache 200 python3 bench/prefix_cache.py --model random:qwen3-8b \
      --devices cuda:0,cuda:1 --lengths 131072 --prefill-chunk 8192 --kv-cache-gb 24 \
      --dir /tmp/pc128 --json "$RUNS/long_cache.json"
    row cache "$RUNS/long_cache.json" --what "Qwen3-8B shape, 2 GPUs" --cmd L4
  fi
}

stage_serve() {  # V1-V3
  local cases=${SERVE:-streams,structured} layouts=cuda:0
  [ "$GPUS" -ge 2 ] && layouts="cuda:0 cuda:0,cuda:1"
  if has "$cases" streams; then
    TAIL=30 run serve_streams 330 python3 bench/concurrency.py --model random:qwen3-8b \
      --layouts $layouts --streams 1,2,4,8,16 --prompt-len 128 --new-tokens 128 \
      --prefill-len 32768 --prefill-chunk 2048 --json "$RUNS/serve_streams.json"
    row concurrency "$RUNS/serve_streams.json" --what "Qwen3-8B shape" --cmd V1
  fi
  if has "$cases" structured; then
    local model=default
    default_model 2> /dev/null || {
      model=/tmp/smol-q4_1.gguf
      random_gguf smollm2-135m-shape q4_1 $model || return 1
    }
    TAIL=10 run serve_structured 220 python3 bench/structured_output.py --model $model \
      --layouts cuda:0 cuda:0,cuda:0 --new-tokens 256 --repeats 3 \
      --json "$RUNS/serve_structured.json"
    row structured "$RUNS/serve_structured.json" --cmd V2
  fi
  if has "$cases" soak && default_model; then
    TAIL=40 run serve_soak $((${SOAK_MIN:-5} * 60 + 180)) python3 bench/soak.py --clients 32 \
      --minutes "${SOAK_MIN:-5}" --json "$RUNS/serve_soak.json" -- --devices cuda:0,cuda:0
  fi
}

stage_startup() {  # T1-T4, T6
  local cases=${STARTUP:-generate}
  if has "$cases" generate; then  # the default model's file (a random-weight GGUF of its shape,
    # quantization and vocabulary under its name: start-up does not depend on the weights)
    local gguf=/tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf i
    random_gguf smollm2-135m-shape q4_1 $gguf || return 1
    rm -rf /tmp/home_cold
    for i in 0 1 2 3; do
      TAIL=3 run "startup_$i" 80 env LAYERSPLIT_HOME=/tmp/home_cold python3 \
        bench/startup_trace.py python3 -m layersplit.launch.cli -v generate \
        'The capital of France is' --model $gguf --max-tokens 64 --ignore-eos --json \
        --devices cuda:0
    done
    row startup "$RUNS"/startup_[0-3].log --what "generate, default model's file with its draft, \
1 GPU" --cmd T1
  fi
  if has "$cases" generate_ab; then  # T1, warm, with a switch on against off (STARTUP_AB_VAR,
    # default LAYERSPLIT_CUDA_CONTEXT_AHEAD: the device's context made beside torch's import),
    # after one run that fills the caches, processes in turn, 4 each; each row's cold figure is
    # that first run's
    local var=${STARTUP_AB_VAR:-LAYERSPLIT_CUDA_CONTEXT_AHEAD} on i
    local gguf=/tmp/home_rnd/models/SmolLM2-135M-Instruct.Q4_1.gguf
    random_gguf smollm2-135m-shape q4_1 $gguf || return 1
    rm -rf /tmp/home_ab
    for i in c 0 1 2 3; do
      for on in 1 0; do
        [ "$i" = c ] && [ "$on" = 0 ] && continue
        TAIL=3 run "startup_ab_${on}_$i" 80 env LAYERSPLIT_HOME=/tmp/home_ab "$var=$on" python3 \
          bench/startup_trace.py python3 -m layersplit.launch.cli -v generate \
          'The capital of France is' --model $gguf --max-tokens 64 --ignore-eos --json \
          --devices cuda:0
      done
    done
    for on in 1 0; do  # (the empty-cache figure of both rows: the first run's, with it on)
      compgen -G "$RUNS/startup_ab_${on}_[0-3].log" >/dev/null || continue
      row startup "$RUNS/startup_ab_1_c.log" "$RUNS"/startup_ab_${on}_[0-3].log --what \
        "generate, default model's file with its draft, 1 GPU, $var=$on (empty caches: =1)" \
        --cmd T1
    done
  fi
  if has "$cases" shape; then  # the default model's shape, no draft, a prompt of token ids
    rm -rf /tmp/home_shape
    for i in 0 1 2 3; do
      TAIL=3 run "startup_shape_$i" 80 env LAYERSPLIT_HOME=/tmp/home_shape python3 \
        bench/startup_trace.py python3 -m layersplit.launch.cli -v generate --token-ids 5,6,7,8,9 \
        --model random:smollm2-135m-shape --max-tokens 64 --ignore-eos --json --devices cuda:0
    done
    row startup "$RUNS"/startup_shape_[0-3].log --what "generate, default model's shape, 1 GPU" \
      --cmd T2
  fi
  if has "$cases" capture; then
    TAIL=14 run startup_capture 200 python3 bench/startup.py --model random:smollm2-135m-shape \
      --devices cuda:0 --repeats 3 --new-tokens 128 --max-context 4096 --max-seqs 1 \
      --json "$RUNS/startup_capture.json"
  fi
  if has "$cases" hybrid; then
    # (a fresh compile cache each: a machine's first start; `generate`'s one slot; then fla-core
    # timing every candidate config, as without the configs shipped for this GPU)
    TAIL=14 run startup_hybrid 150 env LAYERSPLIT_HOME="$(mktemp -d)" python3 bench/startup.py \
      --model random:qwen3.5-27b --devices cuda:0 --repeats 2 --new-tokens 16 \
      --max-context 4096 --max-seqs 1 --json "$RUNS/startup_hybrid.json"
    TAIL=14 run startup_hybrid_autotuned 120 env LAYERSPLIT_HOME="$(mktemp -d)" \
      FLA_CACHE_MODE=disabled python3 bench/startup.py --model random:qwen3.5-27b \
      --devices cuda:0 --repeats 1 --new-tokens 16 --max-context 4096 --max-seqs 1 \
      --json "$RUNS/startup_hybrid_autotuned.json"
  fi
  if has "$cases" hybrid_bare; then  # (as hybrid's first run, fla's modules imported bare)
    TAIL=14 run startup_hybrid_bare 150 env LAYERSPLIT_HOME="$(mktemp -d)" \
      LAYERSPLIT_FLA_BARE_IMPORT=1 python3 bench/startup.py --model random:qwen3.5-27b \
      --devices cuda:0 --repeats 2 --new-tokens 16 --max-context 4096 --max-seqs 1 \
      --json "$RUNS/startup_hybrid_bare.json"
  fi
  if has "$cases" fla_import; then  # fla-core's import, bare and whole, processes in turn (no row)
    for i in 1 2 3; do
      for bare in 1 0; do
        TAIL=1 run "fla_import_${bare}_$i" 60 env LAYERSPLIT_FLA_BARE_IMPORT=$bare python3 -c "
import time, torch
from layersplit.shards.kernels.fla_loading import import_fla
t = time.perf_counter()
import_fla('fla.ops.gated_delta_rule', 'fla.modules.causal_conv1d', 'fla.ops.utils.cache')
print('fla import, bare=$bare: %.2f s' % (time.perf_counter() - t))"
      done
    done
  fi
  if has "$cases" hybrid_ab; then  # T4 with a switch on against off (STARTUP_AB_VAR, default
    # LAYERSPLIT_HYBRID_PREWARM: the prefill kernels compiled ahead), processes in turn
    local var=${STARTUP_AB_VAR:-LAYERSPLIT_HYBRID_PREWARM}
    for i in 1 2; do
      for on in 1 0; do
        TAIL=12 run "startup_hybrid_ab_${on}_$i" 150 env LAYERSPLIT_HOME="$(mktemp -d)" \
          "$var=$on" python3 bench/startup.py --model random:qwen3.5-27b \
          --devices cuda:0 --repeats 2 --new-tokens 16 --max-context 4096 --max-seqs 1 \
          --json "$RUNS/startup_hybrid_ab_${on}_$i.json"
      done
    done
  fi
  if has "$cases" hybrid_profile; then  # (where a first start's time goes: py-spy, no row)
    TAIL=60 run startup_hybrid_profile 200 env LAYERSPLIT_HOME="$(mktemp -d)" \
      /tmp/site/bin/py-spy record --subprocesses --nonblocking --format raw -r 40 \
      -o "$RUNS/startup_hybrid_profile.txt" -- python3 bench/startup.py \
      --model random:qwen3.5-27b --devices cuda:0 --repeats 1 --new-tokens 16 \
      --max-context 4096 --max-seqs 1 &&
      python3 bench/pyspy_summary.py "$RUNS/startup_hybrid_profile.txt" --top 20 \
        > "$OUT/startup_hybrid_profile.md"
  fi
  if has "$cases" serve; then  # the first request after "ready", fresh and after a restart
    default_model || return 1
    TAIL=30 run startup_serve 240 python3 bench/first_request.py --model default \
      --devices cuda:0,cuda:0 --json "$RUNS/startup_serve.json"
    row first "$RUNS/startup_serve.json" --cmd T6
  fi
}

stage_agent() {  # A1
  default_model || return 1
  local gguf=$LAYERSPLIT_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf lcp=()
  if [ -e /tmp/lcp.pid ] && lcp_wait 300; then lcp=(--llamacpp "$gguf"); fi
  TAIL=40 run agent 300 env PYTHONPATH=$PYTHONPATH:/tmp/lcpsite python3 bench/agent_session.py \
    --model default --devices cuda:0,cuda:0 --turns 10 "${lcp[@]}" ${AGENT_ARGS:-} \
    --json "$RUNS/agent.json"
  row agent "$RUNS/agent.json" --cmd A1
  TAIL=8 run agent_keep 120 python3 bench/kept_answers.py --model default --devices \
    cuda:0,cuda:0 --tails 4,16,64,256,1024 --repeats 5 --json "$RUNS/agent_keep.json"
}

stage_fla() {  # fla-core's tuned configs for this GPU, regenerated (no row): $OUT/fla_configs.tgz
  TAIL=8 run fla_configs 240 python3 bench/fla_configs.py \
    --heads "${FLA_HEADS:-16x48,16x32,16x16}" --lengths 64,1024,8192 || return 1
  tar czf "$OUT/fla_configs.tgz" shards/kernels/fla_configs
}

stage_park() { log "parked: $(ls /tmp/smol.part* 2> /dev/null | tr '\n' ' ')"; }

# llama.cpp builds in the background while the stages before the ones that read it run
for s in "$@"; do
  case $s in llamacpp | decode | prefill | agent | quant) [ -s .device-carry/lcp.tgz ] && lcp_start ;; esac
done
for s in "$@"; do
  log "stage $s"
  "stage_$s"
done
log "done; rows in $ROWS"
