#!/usr/bin/env bash
# RL comparisons of tools/rl_compare.py on the lent H200 (no vLLM needed: the presets that use the hf rollout).
# Here first: PYTHON=.venv/bin/python tools/gpu/deepspeed_h200.sh wheels (gearshift and what it imports that
# the image lacks, into .whl-deepspeed/). Then the device tool's run with carry [".whl-deepspeed"]:
#   bash tools/gpu/rl_h200.sh rollout-correction     bf16 hf rollout beside fp32 torch training: none, tis, mis
# Runs and figures come back under $OUT (runs/, docs/).
set -uo pipefail
cd "$(dirname "$0")/../.."
preset=${1:-rollout-correction}; shift || true; out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ ! -d /tmp/site/gearshift ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-deepspeed/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GEARSHIFT_CACHE=/tmp/gscache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${LIMIT:-330}" python3 tools/rl_compare.py "$preset" --jobs 3 --threads 4 --runs "$out/runs" \
  --out "$out/docs" -- "$@" 2>&1 | grep -v "Loading\|Writing\|it/s\]$" | tail -20
