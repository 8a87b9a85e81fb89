#!/usr/bin/env bash
# TRL 1.16's GRPOTrainer (vLLM 0.24 colocated) beside gearshift (vllm + fsdp) on one H200, the same job one after
# the other: tools/gpu/trl_h200.py. Here first: tools/gpu/make_wheels.sh (.whl/, from the committed tree),
# ../shared/tools/vllm-on-h200/make_chunks.sh then `bash tools/gpu/rechunk.sh .carry` (.carry/c01 .. c07 of 48 MiB)
# and tools/gpu/trl_h200/make_wheels.sh (.whl-trl/). Then
# device calls, back to back (a warm machine keeps /tmp): carry .carry/c01 .. c06 with
# `mkdir -p /tmp/chunks && cp .carry/c0?/part.* /tmp/chunks/`, then carry [.carry/c07, .carry/dev, .whl, .whl-trl]:
#   bash tools/gpu/trl_h200.sh check         installs, names any unmet requirement of the carried wheels, imports
#                                            TRL's GRPOTrainer and vLLM, builds the random 0.5B and 7B presets
#   STEPS=10 bash tools/gpu/trl_h200.sh 0.5b  gearshift, then TRL, at 32 prompts x 8 samples x 256 tokens
#   SIDE=gearshift STEPS=8 bash tools/gpu/trl_h200.sh 7b; SIDE=trl STEPS=8 bash tools/gpu/trl_h200.sh 7b
#                                            one side a call where both would not fit in a call's 10 minutes
#   bash tools/gpu/trl_h200.sh summary       both sides of every shape run on this machine, into one JSON
# More options of tools/gpu/trl_h200.py run in OPTS (e.g. OPTS="--trl-micro-batch 16 --trl-sleep off").
# TAG names a variant of gearshift's side, kept apart (folder and files <shape>-<TAG>) and set beside the TRL side
# that already ran untagged on this machine:
#   TAG=compiled SIDE=gearshift OPTS="--set train.options.compile=true" bash tools/gpu/trl_h200.sh 7b
# Output under $OUT: each side's JSON (every step), the job, both logs, summary.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?what to run: check, 0.5b, 1.5b, 7b or summary}; out=${OUT:-/tmp/out}
mkdir -p "$out"
source tools/gpu/vllm_env.sh
# .whl-trl carried with this call, or copied to /tmp/.whl-trl by an earlier call of the same machine (where the
# last call would be over the 64 MiB a call carries: carry .whl-trl with c04 and add `&& cp -r .whl-trl /tmp/`)
wheels=.whl-trl; [ -d "$wheels" ] || wheels=/tmp/.whl-trl
if [ ! -d /tmp/site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$wheels"/*.whl 2>&1 \
    | grep -v "WARNING: Target directory" | tail -3
fi
keep=/tmp/trl_h200  # both sides of a shape, across the calls of one warm machine
case "$what" in
  check)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    python3 tools/gpu/trl_h200.py check "$wheels" --extras vllm
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|vllm|trl|datasets|multiprocess|dill|pyarrow|fsspec|pandas|huggingface.hub|aiohttp|httpx|requests) "
    python3 -c "import vllm, trl; from trl import GRPOConfig, GRPOTrainer; print('trl', trl.__version__, 'vllm', vllm.__version__, 'import fine')" 2>&1 | grep -v UserWarning | tail -3
    for m in ${MODELS:-qwen2-0.5b qwen2-7b}; do
      python3 -c "import sys, time; from gearshift.models import resolve_model; t = time.perf_counter(); p = resolve_model(sys.argv[1]); print(sys.argv[1], f'{time.perf_counter() - t:.1f} s', p)" "$m" 2>&1 | quiet | tail -1
    done ;;
  0.5b|1.5b|7b)
    name=$what${TAG:+-$TAG}
    mkdir -p "$keep/$name"
    # a tagged gearshift side is compared with the TRL side of the untagged folder, when that one ran here
    if [ -n "${TAG:-}" ] && [ "${SIDE:-both}" = gearshift ] && [ -f "$keep/$what/trl.json" ]; then
      cp "$keep/$what/trl.json" "$keep/$name/trl.json"
    fi
    timeout "${LIMIT:-570}" python3 tools/gpu/trl_h200.py run --shape "$what" --steps "${STEPS:-10}" \
      --side "${SIDE:-both}" --budget-s "${BUDGET:-540}" --out "$keep/$name" ${OPTS:-} 2>&1 | quiet | tail -20
    for f in gearshift.json trl.json summary.json job-0.json gearshift.log trl.log; do
      [ -f "$keep/$name/$f" ] && cp "$keep/$name/$f" "$out/$name-$f"
    done ;;
  summary)
    python3 tools/gpu/trl_h200.py summary "$keep"/* --json "$out/trl-h200.json" ;;
  *) echo "unknown: $what (check, 0.5b, 1.5b, 7b or summary)"; exit 2 ;;
esac
