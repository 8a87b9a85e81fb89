#!/usr/bin/env bash
# The switch at realistic shapes on one H200, in few full calls. Here first: tools/gpu/make_wheels.sh (.whl/,
# from the committed tree) and ../shared/tools/vllm-on-h200/make_chunks.sh then
# `bash tools/gpu/rechunk.sh .carry` (.carry/c01 .. c07 of 48 MiB). Then device calls, back to
# back (a warm machine keeps /tmp): carry .carry/c01 .. c06 with
# `mkdir -p /tmp/chunks && cp .carry/c0?/part.* /tmp/chunks/`, then carry [.carry/c07, .carry/dev, .whl] with:
#   bash tools/gpu/h200_realistic.sh build           the random 0.5B, 1.5B and 7B presets, drawn on the GPU (timed)
#   bash tools/gpu/h200_switch.sh switch             (the switch matrix: sync beside copy, one batched copy, own load)
#   CELLS=... STEPS=20 bash tools/gpu/h200_realistic.sh scenario
#                                                    GRPO cells of tools/gpu/grpo_scenario.py, 32 prompts x 8
#   bash tools/gpu/h200_realistic.sh conformance     fsdp and deepspeed with vllm and hf in bf16, default tolerances
#   bash tools/gpu/h200_realistic.sh moe             the suite for tiny mixtures of experts with vllm and sglang (PAIRS)
#   bash tools/gpu/h200_realistic.sh rollout         vLLM alone at the scenario's batch (ROLLOUT_VARIANTS: engine
#                                                    options to compare, ';'-separated, e.g. '{"request_seeds": false}')
#   bash tools/gpu/h200_realistic.sh rollout-profile tools/gpu/profile_rollout.py: where vLLM's rollout time goes
#                                                    (ENGINE_PROCESS=1: and a plain vLLM in processes of its own)
#   bash tools/gpu/h200_realistic.sh profile         one sync under torch.profiler, the KV-cache wake mapped call by
#                                                    call, and a second vLLM engine in one process
# Output under $OUT (the device tool brings it back).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?what to run}; out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh
bf16='{"dtype": "bfloat16"}'
case "$what" in
  build)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    for m in ${MODELS:-qwen2-0.5b qwen2-1.5b qwen2-7b}; do
      python3 - "$m" <<'EOF' 2>&1 | quiet
import sys, time
from gearshift.models import resolve_model
t0 = time.perf_counter(); path = resolve_model(sys.argv[1])
print(f"{sys.argv[1]}: built or found in {time.perf_counter() - t0:.1f} s at {path}")
EOF
    done ;;
  scenario)
    # LIMIT backs up BUDGET (the script stops its own cells at the budget); on SIGTERM it ends the running cell
    timeout "${LIMIT:-$(( ${BUDGET:-540} + 30 ))}" python3 tools/gpu/grpo_scenario.py \
      --cells "${CELLS:-7b-256-fsdp-auto}" --steps "${STEPS:-20}" --budget-s "${BUDGET:-540}" \
      --out "$out/scenario" ${SET:+--set "$SET"} 2>&1 | quiet | tail -40
    cp "$out/scenario/scenario.json" "$out/scenario-${TAG:-run}.json" 2>/dev/null ;;
  conformance)
    for pair in ${PAIRS:-fsdp/vllm deepspeed/vllm fsdp/hf deepspeed/hf}; do
      t=${pair%/*}; r=${pair#*/}
      opts='{}'; [ "$t" = deepspeed ] && opts='{"zero_stage": 3}'
      timeout "${CONF_LIMIT:-320}" python3 -m gearshift conformance --train "$t" --rollout "$r" --model qwen2-0.5b \
        --train-options "$opts" --rollout-options "$bf16" -- -rfE -p no:logging 2>&1 | quiet \
        | tee "$out/conformance-${t}-${r}.log" | grep -E "passed|failed|FAILED|Error" | tail -6
    done ;;
  moe)
    # mixtures of experts (qwen3_moe and mixtral of the MOE_PRESET shape, 4 experts a layer): the experts reach
    # vLLM and SGLang in the form the model folder stores them (gearshift.stored); the CPU engines refuse them, so
    # this is where they are checked. SGLang computes in bf16 only (FlashAttention) and its Qwen3-MoE attention
    # takes no head of 32 (the tiny preset's): `small` has heads of 64. SGLang's runs need its carry installed.
    for pair in ${PAIRS:-fsdp/vllm fsdp/sglang}; do
      r=${pair#*/}; opts='{}'; [ "$r" = sglang ] && opts="$bf16"
      for arch in qwen3_moe mixtral; do
        timeout "${CONF_LIMIT:-300}" python3 -m gearshift conformance --train "${pair%/*}" --rollout "$r" \
          --model "${MOE_PRESET:-small}-$arch" --rollout-options "$opts" -- -rfE -p no:logging 2>&1 | quiet \
          | tee "$out/conformance-moe-$arch-${pair/\//-}.log" | grep -E "passed|failed|FAILED|Error" | tail -6
      done
    done ;;
  profile)
    timeout 150 python3 tools/gpu/profile_sync.py --model qwen2-0.5b --train fsdp --rollout vllm \
      --rollout-options '{"dtype": "bfloat16", "gpu_memory_utilization": 0.3}' --rows 18 2>&1 | quiet \
      | tee "$out/profile-sync.log" | tail -50
    timeout 150 python3 tools/gpu/profile_wake.py --model "${WAKE_MODEL:-qwen2-7b}" 2>&1 | quiet \
      | tee "$out/profile-wake.log" | tail -8
    # the KV cache sized to a 32 x 8 x (64 + 256)-token batch, as `gearshift train` sizes it
    timeout 150 python3 tools/gpu/profile_wake.py --model "${WAKE_MODEL:-qwen2-7b}" --max-batch-tokens 81920 2>&1 \
      | quiet | tee "$out/profile-wake-batch.log" | tail -8
    timeout 120 python3 - <<'EOF' 2>&1 | quiet | tail -4
from gearshift import registry
from gearshift.models import resolve_model
path = resolve_model("qwen2-0.5b")
first = registry.create("rollout", "vllm", model=path, dtype="bfloat16", gpu_memory_utilization=0.2)
first.close()
try:
    second = registry.create("rollout", "vllm", model=path, dtype="bfloat16", gpu_memory_utilization=0.2)
    print("a second vllm engine started in the same process after the first was closed")
    second.close()
except Exception as e:
    print(f"second engine in one process: {type(e).__name__}: {e}")
EOF
    ;;
  rollout)
    # the engine alone at the scenario's batch (32 prompts x 8 x 256 tokens, the KV cache sized to it as
    # `gearshift train` sizes it), once as gearshift builds it and once with each engine option of ROLLOUT_VARIANTS
    # (JSON objects, ';'-separated); vLLM's own lines on scheduling and CUDA graphs kept
    for m in ${MODELS:-qwen2-0.5b}; do
      IFS=';' read -ra variants <<< "{}${ROLLOUT_VARIANTS:+;$ROLLOUT_VARIANTS}"
      for v in "${variants[@]}"; do
        opts=$(python3 -c "import json, sys; print(json.dumps({'vllm': {'dtype': 'bfloat16', 'max_batch_tokens': 32 * 8 * (64 + 256), **json.loads(sys.argv[1])}}))" "$v")
        echo "[$m] vllm $v"
        timeout "${LIMIT:-240}" python3 -m gearshift bench rollout --backends vllm --model "$m" --prompts 32 --n 8 \
          --max-tokens 256 --repeats 3 --options "$opts" 2>&1 | quiet | tee -a "$out/rollout-$m.log" \
          | grep -iE "asynchronous scheduling|cuda ?graph|tokens_per_s|^ *vllm |error" | tail -8
      done
    done ;;
  rollout-profile)
    # the same engine and batch generated as gearshift asks and with each ask left out (a seed per request, the
    # sampled token's logprob), then one call under cProfile
    for m in ${MODELS:-qwen2-0.5b}; do
      timeout "${LIMIT:-240}" python3 tools/gpu/profile_rollout.py --model "$m" --max-tokens "${TOKENS:-256}" \
        ${ENGINE_PROCESS:+--engine-process} 2>&1 \
        | quiet | tee "$out/rollout-profile-$m.log" | grep -vE "^ *(INFO|WARNING|DEBUG)" | tail -70
    done ;;
esac
