#!/usr/bin/env bash
# The train phase of the installed gearshift (.whl, the commit it was built from) against this checkout's own
# packages (packages/*/src first on PYTHONPATH), on one GPU: `gearshift bench train` with a step under
# torch.profiler, the same random batch for both. After the vLLM carry (tools/gpu/h200_realistic.sh's header):
#   SHAPES="qwen2-0.5b:8192 qwen2-7b:4608" BACKENDS=fsdp bash tools/gpu/train_ab.sh
# Each shape is MODEL:TOKENS (tokens per micro-batch); 256 rows of 288 tokens (32 prompts x 8 samples, 144
# prompt and 144 answer tokens each), bf16 weights. CODE="installed tree" picks the sides. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
source tools/gpu/vllm_env.sh
tree=$(ls -d "$PWD"/packages/*/src | paste -sd:)
for shape in ${SHAPES:-qwen2-0.5b:8192 qwen2-7b:4608}; do
  m=${shape%:*}; tokens=${shape#*:}
  for code in ${CODE:-installed tree}; do
    path=/tmp/site; [ "$code" = tree ] && path="$tree:/tmp/site"
    echo "== $m, $tokens tokens a micro-batch, $code code ($( [ "$code" = tree ] && git log -1 --format=%h 2>/dev/null || cat .whl/COMMIT 2>/dev/null | cut -c1-7))"
    PYTHONPATH=$path timeout "${LIMIT:-300}" python3 -m gearshift bench train --backends "${BACKENDS:-fsdp}" \
      --model "$m" --dtype bfloat16 --batch-size 256 --seq-len 288 --max-tokens-per-micro-batch "$tokens" \
      --steps "${STEPS:-2}" --profile 2>&1 | quiet | grep -v "USDT\|Warn\|warn" | tee "$out/train-$m-$code.log" | tail -14
  done
done
