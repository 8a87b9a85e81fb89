#!/usr/bin/env bash
# Builds the pure-Python wheels tools/gpu/h200_checks.sh installs on a machine with no network, into .whl/.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip wheel -q --no-deps packages/core packages/backend-fsdp packages/backend-vllm -w .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl stevedore==5.10.0
ls -la .whl
