#!/usr/bin/env bash
# TRL's own environment for tools/trl_compare.py: .venv-trl with torch 2.13 (CPU), transformers 5.19, trl 1.16.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-trl
.venv-trl/bin/pip install -q torch==2.13.0 transformers==5.19.0 trl==1.16.0 datasets accelerate
.venv-trl/bin/python -c "import trl; print('trl', trl.__version__, 'in .venv-trl')"
