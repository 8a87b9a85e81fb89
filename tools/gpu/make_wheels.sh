#!/usr/bin/env bash
# Builds the wheels the GPU scripts install on a machine with no network, into .whl/: gearshift and its
# in-tree backends (pure Python; SGLang itself travels by tools/gpu/sglang_h200), DeepSpeed 0.19.8 without
# ops, and what they import that the H200 image lacks (stevedore, omegaconf, DeepSpeed's small dependencies;
# pydantic comes with the vLLM carry of ../shared/tools/vllm-on-h200, and with the SGLang carry).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
py=${PYTHON:-$PWD/.venv/bin/python}
# the committed tree, not the working one: what runs there is what `git log` shows
src=$(mktemp -d) && trap 'rm -rf "$src"' EXIT
git archive HEAD packages | tar -x -C "$src"
"$py" -m pip wheel -q --no-deps "$src"/packages/core "$src"/packages/backend-fsdp "$src"/packages/backend-vllm \
  "$src"/packages/backend-deepspeed "$src"/packages/backend-sglang -w .whl
git rev-parse HEAD > .whl/COMMIT
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  stevedore==5.10.0 omegaconf==2.4.0 hjson py-cpuinfo
ls -la .whl
