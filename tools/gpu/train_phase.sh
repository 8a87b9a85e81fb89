#!/usr/bin/env bash
# The 7B train phase alone on one GPU (no vLLM), as the GRPO step at 32 prompts x 8 samples x 256 tokens trains
# it: fsdp in bf16, 256 rows of 260 tokens, each step under torch.profiler's last look (busy share, kernel time
# by kind, MFU), eager and then with compiled decoder layers (`train.options.compile`); then
# tools/compile_matrix.py, compiled layers against uncompiled ones with inductor's GPU code. Here first:
# tools/gpu/make_wheels.sh (.whl/, from the committed tree) and .whl-ds/ (pydantic's wheels). One device call,
# carry [.whl, .whl-ds]:
#   bash tools/gpu/train_phase.sh            all three (BUDGETS: token budgets per micro-batch, comma-separated;
#                                            default 1560, the H100's plan, and 4160 beside it on a larger card)
#   WHAT=eager bash tools/gpu/train_phase.sh  one of eager, compiled, matrix
# Output under $OUT: one log each, compile-matrix.json, gpu.txt. Installs into /tmp/site-train, apart from the
# vLLM carry's /tmp/site, so a later call of the same machine can still carry vLLM.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
site=${SITE:-/tmp/site-train}
if [ ! -f "$site/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl .whl-ds/*.whl \
    2>&1 | grep -v "WARNING: Target directory" | tail -3
  touch "$site/.installed"
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GEARSHIFT_CACHE=/tmp/gscache
echo "gearshift from commit $(cat .whl/COMMIT 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
budgets=${BUDGETS:-1560}
[ -z "${BUDGETS:-}" ] && [ "${mem:-0}" -gt 100000 ] && budgets=1560,4160
common=(bench train --backends fsdp --model "${MODEL:-qwen2-7b}" --dtype bfloat16 --batch-size 256 --seq-len 260
        --max-tokens-per-micro-batch "$budgets" --steps "${STEPS:-2}" --profile)
for what in ${WHAT:-eager compiled matrix}; do
  echo "== $what"
  case "$what" in
    eager) timeout "${LIMIT:-240}" python3 -m gearshift "${common[@]}" > "$out/train-eager.log" 2>&1
           echo "exit $?"; grep -v Warning "$out/train-eager.log" | tail -40 ;;
    compiled) timeout "${LIMIT:-300}" python3 -m gearshift "${common[@]}" --options '{"fsdp": {"compile": true}}' \
                > "$out/train-compiled.log" 2>&1
              echo "exit $?"; grep -v Warning "$out/train-compiled.log" | tail -40 ;;
    matrix) timeout "${MATRIX_LIMIT:-300}" python3 tools/compile_matrix.py --json "$out/compile-matrix.json" \
              > "$out/compile-matrix.log" 2>&1
            echo "exit $?"; grep "^|" "$out/compile-matrix.log" ;;
    *) echo "unknown: $what (eager, compiled or matrix)"; exit 2 ;;
  esac
done
