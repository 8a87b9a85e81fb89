#!/usr/bin/env bash
# Goal 3 of the switch at realistic shapes (the first offload as fast as a steady one) in one device call,
# without the vLLM carry: GRPO at the 0.5B shape, 32 prompts x 8 x 256 tokens, forced offload (optimizer and
# grads to host memory every switch), with the hf rollout engine, for deepspeed ZeRO-3 and fsdp; the scenario
# table's "1st offload" beside "offload" (steady). Needs only .whl/ (tools/gpu/make_wheels.sh). Output under
# $OUT. CELLS (default both), STEPS (default 6), BUDGET (default 300 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
source tools/gpu/vllm_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${LIMIT:-330}" python3 tools/gpu/grpo_scenario.py --rollout hf \
  --cells "${CELLS:-0.5b-256-deepspeed-forced,0.5b-256-fsdp-forced}" --steps "${STEPS:-6}" \
  --budget-s "${BUDGET:-300}" --out "$out/scenario" 2>&1 | quiet | tail -30
cp "$out/scenario/scenario.json" "$out/scenario-offload-hf.json" 2>/dev/null
