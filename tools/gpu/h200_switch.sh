#!/usr/bin/env bash
# The switch on the lent H200s, in few full calls. Here first: tools/gpu/make_wheels.sh (.whl/, from the
# committed tree) and ../shared/tools/vllm-on-h200/make_chunks.sh then
# `bash tools/gpu/rechunk.sh .carry` (.carry/c01 .. c07 of 48 MiB). Then device calls, back to back
# (a warm machine keeps /tmp): carry .carry/c01 .. c06 with `mkdir -p /tmp/chunks && cp .carry/c0?/part.* /tmp/chunks/`,
# then carry [.carry/c07, .carry/dev, .whl] with:
#   bash tools/gpu/h200_switch.sh switch     switch matrix: fsdp->vllm and fsdp->hf at 0.5B and 7B shapes,
#                                           full switch and memory plan (tools/gpu/switch_matrix.py)
#   bash tools/gpu/h200_switch.sh grpo       GRPO steps at 0.5B (vllm) and 7B (vllm, bf16 master weights):
#                                           the switch's share of a step, what the memory plan moved
#   bash tools/gpu/h200_switch.sh deepspeed  deepspeed: conformance with hf (bf16) and the switch bench, 0.5B
#   bash tools/gpu/h200_switch.sh two-gpus   (x2 kind, no vLLM needed) fsdp over both GPUs + hf: the latency
#                                           test 10 times, a GRPO run
# Output under $OUT (the device tool brings it back).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?what to run}; out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh
bf16='{"dtype": "bfloat16"}'
case "$what" in
  switch)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    timeout 560 python3 tools/gpu/switch_matrix.py --models "${MODELS:-qwen2-0.5b,qwen2-7b}" \
      --pairs "${PAIRS:-fsdp/vllm,fsdp/hf}" --train-dtype "${TRAIN_DTYPE:-float32}" --out "$out${TRAIN_DTYPE:+/$TRAIN_DTYPE}" 2>&1 | quiet | tee "$out/switch${TRAIN_DTYPE:+-$TRAIN_DTYPE}.log" | grep -v "^\s*$" ;;
  grpo)
    common=(train.backend=fsdp rollout.backend=vllm rollout.n=8 run.prompts_per_step=16 run.checkpoint_every=0
            run.progress=false run.samples_per_step=0 algorithm.entropy_coef=0.01 rollout.max_tokens=16
            'rollout.options={"gpu_memory_utilization": 0.3}' run.tensorboard=false run.plot=false)
    timeout 250 python3 -m gearshift train model.path=qwen2-0.5b "${common[@]}" run.steps=8 \
      run.output_dir="$out/grpo-0.5b" model.dtype=bfloat16 2>&1 | quiet | tail -6
    timeout 300 python3 -m gearshift train model.path=qwen2-7b model.dtype=bfloat16 "${common[@]}" run.steps=5 \
      run.output_dir="$out/grpo-7b" 2>&1 | quiet | tail -6
    python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
for run in ("grpo-0.5b", "grpo-7b"):
    path = Path(sys.argv[1]) / run / "metrics.jsonl"
    if not path.exists():
        print(run, "no metrics"); continue
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    for r in rows:
        step, sw = r["time/step"], r["time/switch_to_rollout"] + r["time/switch_to_train"]
        print(f"{run} step {r['step']}: {step:.2f} s, switches {sw:.3f} s ({100 * sw / step:.1f}%), "
              f"rollout {r['time/rollout']:.2f} s, train {r.get('time/train', 0):.2f} s, "
              f"peak {r['memory/peak_gb']:.1f} GB, " + " ".join(f"{k}={v:.4f}" for k, v in r.items()
                                                            if k.startswith("switch/")))
EOF
    ;;
  deepspeed)
    timeout 300 python3 -m gearshift conformance --train deepspeed --rollout hf --model qwen2-0.5b \
      --train-options '{"zero_stage": 3}' --rollout-options "$bf16" --atol 0.5 -- -rA 2>&1 | quiet \
      | tee "$out/deepspeed-conformance.log" | grep -E "passed|failed|FAILED|Error" | tail -15
    timeout 200 python3 tools/gpu/switch_matrix.py --models qwen2-0.5b --pairs deepspeed/hf,deepspeed/vllm \
      --modes full --out "$out/deepspeed" 2>&1 | quiet | tee "$out/deepspeed-switch.log" | grep -v "^\s*$" ;;
  two-gpus)
    nvidia-smi topo -m | head -4
    ok=0
    for i in $(seq 10); do
      # each rank's output in its own file; a rank stuck in a collective dumps its stacks after 120 s
      GEARSHIFT_DIST_TIMEOUT=120 timeout 300 torchrun --nproc_per_node 2 --log_dir "$out/ranks-$i" --redirects 3 \
        -m gearshift conformance --train fsdp --rollout hf --model qwen2-0.5b \
        --rollout-options "$bf16" --atol 0.5 -- -k "latency or logprobs_agree" -rA > "$out/two-gpus-$i.log" 2>&1
      code=$?
      [ $code = 0 ] && ok=$((ok + 1))
      echo "run $i: exit $code; $(grep -rhE '^(sync|copy limit|naive)' "$out/ranks-$i" | head -3 | tr -s ' ' | tr '\n' ';')"
      grep -rh "FAILED\|ERROR\|Error" "$out/ranks-$i" | head -6
    done
    echo "latency and logprob tests passed on both ranks in $ok of 10 runs"
    timeout 200 torchrun --nproc_per_node 2 -m gearshift train model.path=qwen2-0.5b train.backend=fsdp \
      rollout.backend=hf rollout.dtype=bfloat16 run.steps=4 run.prompts_per_step=16 rollout.n=8 \
      run.checkpoint_every=2 algorithm.entropy_coef=0.01 run.output_dir="$out/grpo2" run.progress=false 2>&1 \
      | quiet | tail -8 ;;
esac
