#!/usr/bin/env bash
# The wheels TRL 1.16's GRPOTrainer needs on the lent H200 beyond what is there, into .whl-trl/ (about 1.7 MiB):
# trl itself, datasets and datasets' multiprocess. Everything else TRL and datasets require is in the H200 image
# (accelerate 1.15, transformers 5.17, torch 2.11, huggingface-hub 1.33, pandas, pyarrow, numpy, xxhash, fsspec,
# httpx, requests, tqdm, pyyaml, jinja2, psutil, aiohttp) or in the vLLM carry of ../shared/tools/vllm-on-h200
# (vllm 0.24.0, dill 0.4.1). `bash tools/gpu/trl_h200.sh check` reads every carried wheel's Requires-Dist
# there and names any requirement the machine does not meet.
# datasets 5.0.1: the newest that needs no more than pyarrow>=21 (TRL's own floor; 5.1 and later need >=24).
set -euo pipefail
cd "$(dirname "$0")/../../.."
rm -rf .whl-trl && mkdir -p .whl-trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-trl \
  trl==1.16.0 datasets==5.0.1 multiprocess==0.70.19
ls -la .whl-trl
