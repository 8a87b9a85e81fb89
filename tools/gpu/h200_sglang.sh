#!/usr/bin/env bash
# The sglang rollout backend on one H200, in bf16. Here first: tools/gpu/make_wheels.sh (.whl/, from the committed
# tree) and tools/gpu/sglang_h200/make_chunks.sh (.carry-sglang/). Then device calls, back to back (a warm
# machine keeps /tmp): carry .carry-sglang/c01 .. c09, one a call, with
# `mkdir -p /tmp/chunks-sglang && cp .carry-sglang/c*/part.* /tmp/chunks-sglang/`, then carry
# [.carry-sglang/c10, .carry-sglang/dev, .whl] with (tools/gpu/sglang_h200/README.md has the whole sequence):
#   bash tools/gpu/h200_sglang.sh conformance   fsdp + sglang and deepspeed (ZeRO-3) + sglang at the 0.5B shape,
#                                              test_sleep_frees_memory included (SGLang's memory saver, by tag)
#   bash tools/gpu/h200_sglang.sh bench         gearshift bench switch --train fsdp --rollout sglang at 0.5B and 7B
#                                              (MODELS=...): sync beside the copy, SGLang's own
#                                              update_weights_from_tensor, PCIe and naive (one file round
#                                              trip: 21 s at 7B; NAIVE=0 leaves it out). A fresh machine's 7B
#                                              bench takes about 4 minutes (preset, SGLang's first graph
#                                              capture): LIMIT=280 at least. TRAIN_DTYPE=bfloat16: bf16 master
#                                              weights (the sync then reads half the bytes it reads from fp32)
#   bash tools/gpu/h200_sglang.sh rollout       SGLang alone at the scenario's batch (32 x 8 x 256 tokens)
#   CELLS=... bash tools/gpu/h200_sglang.sh scenario
#                                              GRPO cells of tools/gpu/grpo_scenario.py with --rollout sglang,
#                                              32 prompts x 8 x 256 tokens, 20 steps (0.5B by default)
#   bash tools/gpu/h200_sglang.sh load-profile tools/gpu/profile_sglang_load.py at 7B from bf16 masters (MODELS,
#                                              TRAIN_DTYPE): the load's parts in the scheduler and the host's side
#                                              (CPROFILE=N: the host's N costliest functions under cProfile too)
#   bash tools/gpu/h200_sglang.sh build        the random 0.5B and 7B presets, drawn on the GPU (a fresh machine
#                                              builds what the others need on first use: 7B takes minutes)
# Several at once: `bash tools/gpu/h200_sglang.sh conformance bench`. Output under $OUT (the device tool brings
# it back).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "what to run: conformance, bench, rollout, scenario, build, load-profile"; exit 2; }
out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh  # the gearshift wheels (and the vLLM carry, where it came along) into /tmp/site
bash .carry-sglang/dev/install.sh || exit 1
# the transformers SGLang 0.5.17 pins (sglang_h200/own.txt), ahead of the image's for SGLang's runs only
export PYTHONPATH=/tmp/site-sglang:$PYTHONPATH
# flashinfer (SGLang's sampler) compiles its kernels on first use: keep them under /tmp with the rest
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer SGLANG_CACHE_DIR=/tmp/sglang_cache
bf16='{"dtype": "bfloat16"}'
# timeout ends a command with no word of its own: say which one it was
stopped() { [ "$1" = 124 ] && echo "$2: stopped at its time limit (LIMIT=${LIMIT:-its default} s); raise LIMIT"; true; }
for what in "$@"; do
  case "$what" in
    build)
      MODELS="${MODELS:-qwen2-0.5b qwen2-7b}" bash tools/gpu/h200_realistic.sh build ;;
    conformance)
      for t in ${TRAINS:-fsdp deepspeed}; do
        opts='{}'; [ "$t" = deepspeed ] && opts='{"zero_stage": 3}'
        timeout "${LIMIT:-420}" python3 -m gearshift conformance --train "$t" --rollout sglang --model qwen2-0.5b \
          --train-options "$opts" --rollout-options "$bf16" -- -rfEx -p no:logging 2>&1 | quiet \
          | tee "$out/conformance-${t}-sglang.log" | grep -E "passed|failed|FAILED|XPASS|XFAIL|Error" | tail -8
        stopped "${PIPESTATUS[0]}" "conformance $t + sglang"
      done ;;
    bench)
      for m in ${MODELS:-qwen2-0.5b qwen2-7b}; do
        # TRAIN_DTYPE: the trainer's master weights (float32 by default; bfloat16 as the scenario trains 7B)
        timeout "${LIMIT:-280}" python3 -m gearshift bench switch --train fsdp --rollout sglang --model "$m" \
          --naive-switches "${NAIVE:-1}" \
          --train-options "{\"param_dtype\": \"bfloat16\", \"dtype\": \"${TRAIN_DTYPE:-float32}\"}" \
          --rollout-options '{"dtype": "bfloat16"}' --out "$out/bench-$m${TRAIN_DTYPE:+-$TRAIN_DTYPE}" 2>&1 \
          | quiet | tee "$out/bench-$m${TRAIN_DTYPE:+-$TRAIN_DTYPE}.log" | tail -24
        stopped "${PIPESTATUS[0]}" "bench $m"
      done ;;
    rollout)  # the engine alone at the scenario's batch, as h200_realistic.sh rollout measures vLLM
      for m in ${MODELS:-qwen2-0.5b}; do
        timeout "${LIMIT:-240}" python3 -m gearshift bench rollout --backends sglang --model "$m" --prompts 32 \
          --n 8 --max-tokens 256 --repeats 3 \
          --options '{"sglang": {"dtype": "bfloat16", "max_batch_tokens": 81920}}' 2>&1 | quiet \
          | tee "$out/rollout-sglang-$m.log" | grep -iE "tokens_per_s|^ *sglang |error" | tail -6
        stopped "${PIPESTATUS[0]}" "rollout $m"
      done ;;
    scenario)
      timeout "${LIMIT:-560}" python3 tools/gpu/grpo_scenario.py --rollout sglang \
        --cells "${CELLS:-0.5b-256-fsdp-auto}" --steps "${STEPS:-20}" --budget-s "${BUDGET:-540}" \
        --out "$out/scenario" 2>&1 | quiet | tail -40
      stopped "${PIPESTATUS[0]}" "scenario"
      cp "$out/scenario/scenario.json" "$out/scenario-sglang-${TAG:-run}.json" 2>/dev/null ;;
    load-profile)  # the sync's load split into the scheduler's parts and the host's side (profile_sglang_load.py)
      for m in ${MODELS:-qwen2-7b}; do
        timeout "${LIMIT:-300}" python3 tools/gpu/profile_sglang_load.py --model "$m" \
          --train-options "{\"param_dtype\": \"bfloat16\", \"dtype\": \"${TRAIN_DTYPE:-bfloat16}\"}" \
          --cprofile "${CPROFILE:-0}" 2>&1 | quiet \
          | tee "$out/load-profile-$m.log" | tail -$((24 + ${CPROFILE:-0}))
        stopped "${PIPESTATUS[0]}" "load-profile $m"
      done ;;
    *) echo "unknown: $what (conformance, bench, rollout, scenario, build, load-profile)"; exit 2 ;;
  esac
done
