#!/usr/bin/env bash
# GPU checks on a CUDA machine with no network (the lent H200): the fsdp + hf pair through the
# conformance suite in bf16 on a 0.5B-shape random Qwen2, the switch benchmark beside a plain device
# copy of the same bytes, and a few GRPO steps. Wheels of gearshift, gearshift-fsdp and stevedore
# travel in .whl/ (build them with tools/gpu/make_wheels.sh).
#   tools/gpu/h200_checks.sh conformance|bench|share|grpo|two-gpus|fsdp-tests [OUT]
set -uo pipefail
what=${1:?what to run}; out=${2:-${OUT:-/tmp/out}}
mkdir -p "$out"
if [ ! -d /tmp/site/gearshift ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export GEARSHIFT_CACHE=/tmp/gscache CUBLAS_WORKSPACE_CONFIG=:4096:8
bf16='{"dtype": "bfloat16"}'
case "$what" in
  conformance)
    python3 -m gearshift env
    python3 -m gearshift conformance --train fsdp --rollout hf --model qwen2-0.5b \
      --rollout-options "$bf16" --atol 0.5 -- -rA --junitxml "$out/conformance.xml" 2>&1 | tee "$out/conformance.log" ;;
  bench)
    python3 -m gearshift bench switch --train fsdp --rollout hf --model qwen2-0.5b --rollout-options "$bf16" \
      --switches 5 --out "$out" 2>&1 | tee "$out/bench.log" ;;
  share)  # float32 on both sides, one GPU: the hf engine serves from the trainer's own tensors
    python3 -m gearshift conformance --train torch --rollout hf --model qwen2-0.5b \
      -- -rA --junitxml "$out/share-conformance.xml" 2>&1 | tee "$out/share-conformance.log" | tail -40
    python3 -m gearshift bench switch --train fsdp --rollout hf --model qwen2-0.5b --switches 5 \
      --out "$out/share" 2>&1 | tee "$out/share-bench.log" | tail -22 ;;
  grpo)  # a random model earns no reward: the entropy bonus gives the update a gradient all the same
    python3 -m gearshift train model.path=qwen2-0.5b train.backend=fsdp rollout.backend="${ROLLOUT:-hf}" \
      rollout.dtype=bfloat16 run.steps=4 run.prompts_per_step=16 rollout.n=8 run.checkpoint_every=2 \
      algorithm.entropy_coef=0.01 run.output_dir="$out/grpo-${ROLLOUT:-hf}" run.progress=false 2>&1 \
      | tee "$out/grpo-${ROLLOUT:-hf}.log" ;;
  vllm)  # after ../shared/tools/vllm-on-h200 put vLLM 0.24 in /tmp/site
    export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_CACHE_ROOT=/tmp/vllm_cache
    timeout 300 python3 -m gearshift conformance --train fsdp --rollout vllm --model qwen2-0.5b \
      --rollout-options "$bf16" --atol 0.5 -- -rA -p no:logging 2>&1 | tee "$out/vllm-conformance.log" | tail -60
    timeout 120 python3 -m gearshift bench switch --train fsdp --rollout vllm --model qwen2-0.5b \
      --rollout-options "$bf16" --switches 5 --out "$out" 2>&1 | tail -25
    timeout 120 python3 -m gearshift bench rollout --backends hf,vllm --model qwen2-0.5b --prompts 32 --n 4 \
      --max-tokens 128 --options '{"hf": {"dtype": "bfloat16"}, "vllm": {"dtype": "bfloat16"}}' 2>&1 | tail -5
    ROLLOUT=vllm timeout 150 bash "$0" grpo "$out" 2>&1 | grep -v "Loading\|Writing" | tail -8 ;;
  two-gpus)  # torchrun over 2 GPUs (NCCL): fsdp shards over both, one hf replica per GPU
    torchrun --nproc_per_node 2 -m gearshift conformance --train fsdp --rollout hf --model qwen2-0.5b \
      --rollout-options "$bf16" --atol 0.5 -- -rA 2>&1 | tee "$out/two-gpus-conformance.log" | grep -v "^\[rank1\]" | tail -40
    torchrun --nproc_per_node 2 -m gearshift train model.path=qwen2-0.5b train.backend=fsdp rollout.backend=hf \
      rollout.dtype=bfloat16 run.steps=4 run.prompts_per_step=16 rollout.n=8 run.checkpoint_every=2 \
      algorithm.entropy_coef=0.01 run.output_dir="$out/grpo2" run.progress=false 2>&1 \
      | tee "$out/two-gpus-grpo.log" | grep -v "Loading\|Writing" | tail -12 ;;
  fsdp-tests)
    python3 -m pytest packages/backend-fsdp/tests -m gpu -rA -p no:cacheprovider 2>&1 | tee "$out/fsdp-gpu.log" ;;
esac
