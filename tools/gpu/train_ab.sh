#!/usr/bin/env bash
# The train phase of two versions of gearshift side by side on one GPU: `gearshift bench train` with a step
# under torch.profiler, the same random batch for both. A side (CODE, default "installed tree") is `installed`
# (.whl, the commit it was built from), `tree` (this checkout's packages/*/src first on PYTHONPATH) or a folder
# holding another version's packages/*/src (`git archive COMMIT packages | tar -x -C DIR`, copied to the device).
# After the vLLM carry (tools/gpu/h200_realistic.sh's header):
#   SHAPES="qwen2-0.5b:8192 qwen2-7b:4608" CODE="/tmp/ab-old installed" bash tools/gpu/train_ab.sh
# Each shape is MODEL:TOKENS (tokens per micro-batch); 256 rows of 288 tokens (32 prompts x 8 samples, 144
# prompt and 144 answer tokens each), DTYPE weights (default bfloat16; float32 trains with bf16 compute through
# FSDP's param_dtype on a GPU); BACKENDS (default fsdp); OPTS engine options as bench
# train's --options JSON (e.g. '{"fsdp": {"one_rank": "fsdp"}}'). Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
source tools/gpu/vllm_env.sh
srcs() { ls -d "$1"/packages/*/src | paste -sd:; }
for shape in ${SHAPES:-qwen2-0.5b:8192 qwen2-7b:4608}; do
  m=${shape%:*}; tokens=${shape#*:}
  # the preset is built (or found) before either side, so no side's time limit pays for the build
  python3 -c "import sys; from gearshift.models import resolve_model; print('model', resolve_model(sys.argv[1]))" \
    "$m" 2>&1 | quiet | tail -1
  for code in ${CODE:-installed tree}; do
    case "$code" in
      installed) path=/tmp/site; what="gearshift $(cut -c1-7 .whl/COMMIT 2>/dev/null)" ;;
      tree) path="$(srcs "$PWD"):/tmp/site"; what="this checkout" ;;
      *) path="$(srcs "$code"):/tmp/site"; what="$(cat "$code/COMMIT" 2>/dev/null | cut -c1-7) from $code" ;;
    esac
    name=$(basename "$code")
    echo "== $m, $tokens tokens a micro-batch, $what"
    # the whole output kept (`.full.log`), the exit status said: a side that fails or runs out of time shows it
    PYTHONPATH=$path timeout "${LIMIT:-300}" python3 -m gearshift bench train --backends "${BACKENDS:-fsdp}" \
      --model "$m" --dtype "${DTYPE:-bfloat16}" --batch-size 256 --seq-len 288 --max-tokens-per-micro-batch "$tokens" \
      --steps "${STEPS:-2}" --options "${OPTS:-{\}}" --profile > "$out/train-$m-$name.full.log" 2>&1
    rc=$?
    quiet < "$out/train-$m-$name.full.log" | grep -v "USDT\|Warn\|warn" > "$out/train-$m-$name.log"
    tail -14 "$out/train-$m-$name.log"
    [ "$rc" = 0 ] || echo "$m, $what: exit $rc$([ "$rc" = 124 ] && echo " (over LIMIT=${LIMIT:-300} s)")"
  done
done
