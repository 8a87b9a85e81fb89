#!/usr/bin/env bash
# Tensor and sequence parallelism on two GPUs of one host (the nvidia-h200-x2 kind). Written for such a machine,
# not yet run on one. Here first: tools/gpu/make_wheels.sh (.whl/, from the committed tree) and, for the vLLM
# commands, ../shared/tools/vllm-on-h200/make_chunks.sh (.carry/, installed as h200_switch.sh describes). Then
# the device tool's run (kind nvidia-h200-x2) with carry [.carry/c07, .carry/dev, .whl]:
#   bash tools/gpu/tp2_h200x2.sh train     fsdp on dp=1,tp=2 and sp=2 beside dp=2: the equality test (loss and every
#                                         gradient against one process), the conformance suite with hf at tp=2, and
#                                         gearshift bench train with a long sequence (activation peak per rank)
#   bash tools/gpu/tp2_h200x2.sh rollout   vllm tp=2: rollout and pair suites with fsdp dp=2, each rank's slice
#   bash tools/gpu/tp2_h200x2.sh switch    gearshift bench switch fsdp -> vllm tp=2 at the 0.5B and 1.5B shapes,
#                                         slices declared against whole weights in the same run
#   bash tools/gpu/tp2_h200x2.sh grpo      GRPO at the 0.5B shape: train.mesh=tp=2 and sp=2 beside dp=2,
#                                         rollout vllm tp=2
# Output under $OUT (the device tool brings it back).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?what to run: train, rollout, switch or grpo}; out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run2() { torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "${PORT:-29500}" "$@"; }
case "$what" in
  train)
    # the equality and conformance tests take fp32 references; they run the same on GPUs (nccl)
    (cd packages/backend-fsdp/tests && timeout 300 python3 -m pytest test_parallel.py -q -s -p no:cacheprovider \
      2>&1 | quiet | tail -25) | tee "$out/parallel.log"
    (cd packages/backend-fsdp/tests && timeout 300 python3 -m pytest test_two_processes.py -q -p no:cacheprovider \
      -k "tp or sp" 2>&1 | quiet | tail -8) | tee "$out/two-processes.log"
    for mesh in dp=2 sp=2 tp=2; do
      timeout 200 run2 -m gearshift bench train --backends fsdp --model qwen2-0.5b --batch-size 1 \
        --seq-len 8192 --steps 2 --mesh "$mesh" --options '{"fsdp": {"param_dtype": "bfloat16"}}' 2>&1 | quiet \
        | tail -3 | tee -a "$out/bench-train.log"
    done ;;
  rollout)
    (cd packages/backend-vllm/tests && timeout 500 run2 -m pytest tp_ranks.py -q -rA -s -p no:cacheprovider \
      --gearshift-model tiny4h 2>&1 | quiet | grep -E "PASSED|FAILED|FIGURE|passed|failed" | tail -40) \
      | tee "$out/vllm-tp2.log" ;;
  switch)
    for model in qwen2-0.5b qwen2-1.5b; do
      timeout 270 run2 -m gearshift bench switch --train fsdp --rollout vllm --model "$model" --against-whole \
        --train-options '{"param_dtype": "bfloat16"}' \
        --rollout-options '{"mesh": "tp=2", "dtype": "bfloat16", "gpu_memory_utilization": 0.3}' \
        --out "$out/switch-$model" 2>&1 | quiet | tail -14
    done ;;
  grpo)
    common=(model.path=qwen2-0.5b model.dtype=bfloat16 train.backend=fsdp rollout.backend=vllm rollout.mesh=tp=2
            rollout.n=8 run.prompts_per_step=16 run.steps=8 run.checkpoint_every=0 run.progress=false
            rollout.max_tokens=16 'rollout.options={"gpu_memory_utilization": 0.3}' run.tensorboard=false
            run.plot=false)
    for mesh in dp=2 tp=2 sp=2; do
      timeout 170 run2 -m gearshift train "${common[@]}" train.mesh="$mesh" run.output_dir="$out/grpo-$mesh" \
        2>&1 | quiet | tail -3
    done ;;
  *) echo "unknown: $what (train, rollout, switch or grpo)"; exit 2 ;;
esac
