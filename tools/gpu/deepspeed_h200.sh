#!/usr/bin/env bash
# The deepspeed train backend on a CUDA machine with no network (the lent H200).
#
#   PYTHON=.venv/bin/python tools/gpu/deepspeed_h200.sh wheels   here, with PyPI: wheels of gearshift, gearshift-deepspeed,
#                                               DeepSpeed 0.19.8 (pure Python, no ops) and what it imports
#                                               that the H200 image lacks, into .whl-deepspeed/ (cp312 manylinux)
#   tools/gpu/deepspeed_h200.sh conformance|bench|bench-large|tests|grpo|all [OUT]   on the GPU machine
#                                               (the device tool's run with carry [".whl-deepspeed"])
#
# conformance: the suite, deepspeed (ZeRO-3, bf16 compute, fp32 master weights) + hf in bf16, 0.5B shape.
# bench: `gearshift bench switch --train deepspeed --rollout hf` at the 0.5B shape (ZeRO-3 and ZeRO-2),
#   printing the copy-limit and naive columns beside the sync. bench-large: ZeRO-3 at a larger shape
#   (MODEL=qwen2-1.5b | qwen2-7b or a local folder; NAIVE= the naive switches, 1 at 7B: each writes the model).
#   tests: the package's gpu-marked tests (FusedAdam builds with nvcc there;
#   the image's TORCH_CUDA_ARCH_LIST=9.0a is not parsed by DeepSpeed's builder, so it is set to 9.0).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?what to run}; out=${2:-${OUT:-/tmp/out}}

if [ "$what" = wheels ]; then
  set -e
  grep -qx '/.whl-deepspeed/' .git/info/exclude 2>/dev/null || echo '/.whl-deepspeed/' >> .git/info/exclude
  rm -rf .whl-deepspeed && mkdir -p .whl-deepspeed
  "${PYTHON:-python3}" -m pip wheel -q --no-deps packages/core packages/backend-deepspeed -w .whl-deepspeed
  DS_BUILD_OPS=0 "${PYTHON:-python3}" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl-deepspeed
  # the core's config (gearshift train) reads OmegaConf
  "${PYTHON:-python3}" -m pip wheel -q --no-deps omegaconf==2.4.0 -w .whl-deepspeed
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl-deepspeed \
    stevedore==5.10.0 hjson msgpack pydantic pydantic-core annotated-types typing-inspection py-cpuinfo einops
  ls -la .whl-deepspeed
  exit 0
fi

mkdir -p "$out"
if [ ! -d /tmp/site/gearshift_deepspeed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-deepspeed/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export GEARSHIFT_CACHE=/tmp/gscache CUBLAS_WORKSPACE_CONFIG=:4096:8 TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
bf16='{"dtype": "bfloat16"}'
model=${MODEL:-qwen2-0.5b}

case "$what" in
  conformance)
    python3 -m gearshift env
    python3 -m gearshift conformance --train deepspeed --rollout hf --model qwen2-0.5b \
      --train-options '{"zero_stage": 3}' --rollout-options "$bf16" --atol 0.5 \
      -- -rA --junitxml "$out/deepspeed-conformance.xml" 2>&1 | tee "$out/deepspeed-conformance.log" | tail -50 ;;
  bench)
    for stage in 3 2; do
      python3 -m gearshift bench switch --train deepspeed --rollout hf --model qwen2-0.5b \
        --train-options "{\"zero_stage\": $stage}" --rollout-options "$bf16" --switches 5 \
        --out "$out/zero$stage" 2>&1 | tee "$out/deepspeed-bench-zero$stage.log" | tail -25
    done ;;
  bench-large)
    python3 -m gearshift bench switch --train deepspeed --rollout hf --model "$model" \
      --train-options '{"zero_stage": 3}' --rollout-options "$bf16" --switches 5 --naive-switches "${NAIVE:-3}" \
      --out "$out/large" 2>&1 | tee "$out/deepspeed-bench-large.log" | tail -25 ;;
  tests)
    python3 -m pytest packages/backend-deepspeed/tests -m gpu --runslow -rA -p no:cacheprovider 2>&1 \
      | tee "$out/deepspeed-gpu-tests.log" | tail -30 ;;
  grpo)  # a random model earns no reward: the entropy bonus gives the update a gradient all the same
    python3 -m gearshift train model.path=qwen2-0.5b train.backend=deepspeed rollout.backend=hf \
      rollout.dtype=bfloat16 run.steps=4 run.prompts_per_step=16 rollout.n=8 run.checkpoint_every=2 \
      algorithm.entropy_coef=0.01 run.output_dir="$out/grpo-deepspeed" run.progress=false 2>&1 \
      | tee "$out/deepspeed-grpo.log" | grep -v "Loading\|Writing" | tail -12 ;;
  all)
    for step in tests conformance bench grpo; do bash "$0" "$step" "$out"; done ;;
  *)
    echo "unknown step $what: wheels, conformance, bench, bench-large, tests, grpo or all" >&2; exit 2 ;;
esac
