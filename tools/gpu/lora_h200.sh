#!/usr/bin/env bash
# LoRA with vLLM on the lent H200: the adapter sync (model.lora.sync=adapter) beside the merged one. Here first:
# tools/gpu/make_wheels.sh (.whl/, from the committed tree) and ../shared/tools/vllm-on-h200/make_chunks.sh then
# `bash tools/gpu/rechunk.sh .carry` (.carry/c01 .. c07 of 48 MiB).
# Then device calls, back to back (a warm machine keeps /tmp): carry .carry/c01 .. c06 with
# `mkdir -p /tmp/chunks && cp .carry/c0?/part.* /tmp/chunks/`, then carry [.carry/c07, .carry/dev, .whl] with:
#   bash tools/gpu/lora_h200.sh tests     the vllm conformance pair with a LoRA trainer (fp32: skipped on a GPU,
#                                        whose LoRA kernels take half precision; grpo below runs it in bf16)
#   bash tools/gpu/lora_h200.sh bench     gearshift bench switch --lora-r 16, torch -> vllm, bf16, at MODELS
#                                        (default qwen2-0.5b,qwen2-1.5b): merged and adapter sync, bytes and time
#   bash tools/gpu/lora_h200.sh rollout   tools/gpu/lora_rollout.py at MODELS: generation tokens/s with the
#                                        adapter on the base against the merged weights, logprob gap to training
#   bash tools/gpu/lora_h200.sh grpo      GRPO at 0.5B with LoRA r=16, merged and adapter sync: step, switch and
#                                        rollout times
# Several at once: bash tools/gpu/lora_h200.sh tests bench. Output under $OUT (the device tool brings it back).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh
models=${MODELS:-qwen2-0.5b,qwen2-1.5b}
for what in "$@"; do
  case "$what" in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider packages/backend-vllm/tests/test_conformance.py \
        -k "LoraVLLMAdapter" tests/test_lora_export_vllm.py -rA 2>&1 | quiet | tee "$out/tests.log" \
        | grep -E "passed|failed|FAILED|Error|SKIPPED" | tail -20 ;;
    bench)
      for m in ${models//,/ }; do
        timeout 300 python3 -m gearshift bench switch --train torch --rollout vllm --model "$m" --lora-r 16 \
          --naive-switches 1 --train-options '{"dtype": "bfloat16"}' \
          --rollout-options '{"dtype": "bfloat16", "gpu_memory_utilization": 0.3}' --out "$out/bench-$m" 2>&1 \
          | quiet | tee "$out/bench-$m.log" | grep -A8 "^sync (export"
      done ;;
    rollout)
      for m in ${models//,/ }; do
        for mode in ${MODES:-merged adapter}; do  # one vLLM engine a process on a GPU
          timeout 240 python3 tools/gpu/lora_rollout.py --model "$m" --r 16 --modes $mode --out "$out/rollout" \
            2>&1 | quiet | tee "$out/rollout-$m-$mode.log" | tail -3
        done
      done ;;
    grpo)
      for sync in merged adapter; do
        timeout 200 python3 -m gearshift train model.path=qwen2-0.5b model.dtype=bfloat16 train.backend=torch \
          rollout.backend=vllm model.lora.r=16 model.lora.sync=$sync rollout.n=8 run.prompts_per_step=16 \
          rollout.max_tokens=16 run.steps=6 run.checkpoint_every=0 run.progress=false run.samples_per_step=0 \
          'rollout.options={"gpu_memory_utilization": 0.3}' run.tensorboard=false run.plot=false \
          run.output_dir="$out/grpo-$sync" 2>&1 | quiet | tail -3
      done
      python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
for sync in ("merged", "adapter"):
    path = Path(sys.argv[1]) / f"grpo-{sync}" / "metrics.jsonl"
    if not path.exists():
        print(sync, "no metrics"); continue
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()][1:]  # the first step warms up
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)
    print(f"{sync}: step {med('time/step'):.3f} s, to rollout {1e3 * med('time/switch_to_rollout'):.1f} ms "
          f"(export {1e3 * med('switch/export'):.1f}, load {1e3 * med('switch/load'):.1f}), rollout "
          f"{med('time/rollout'):.3f} s ({med('rollout/tokens_per_s'):.0f} tokens/s), train "
          f"{med('time/train'):.3f} s, mismatch max {max(r['mismatch/logprob_max'] for r in rows):.3f}")
EOF
      ;;
    *) echo "unknown: $what (tests, bench, rollout, grpo)"; exit 2 ;;
  esac
done
