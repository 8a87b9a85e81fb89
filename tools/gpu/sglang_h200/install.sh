#!/usr/bin/env bash
# On the H200 machine, from the repo root, once the chunks reached /tmp/chunks-sglang in earlier calls of the
# same warm machine (the last one may come in this call's carry): checks them, unpacks them and installs
# sglang 0.5.17 into /tmp/site beside whatever is there already (the vLLM carry, the gearshift wheels), and the
# wheels it needs at other versions than the image's (own.txt: transformers) into /tmp/site-sglang.
#   bash .carry-sglang/dev/install.sh && export PYTHONPATH=/tmp/site-sglang:/tmp/site:$PYTHONPATH && <your command>
# Idempotent: a second run on the same machine only checks that sglang imports.
set -o pipefail
repo=$(pwd)
C="$repo/.carry-sglang"
python3 -c 'import sys, torch; assert sys.version_info[:2] == (3, 12) and torch.__version__.startswith("2.11.0"), (sys.version, torch.__version__); assert torch.version.cuda.startswith("13"), torch.version.cuda' \
  || { echo "sglang 0.5.17 and its kernels need Python 3.12 with torch 2.11.0 on CUDA 13 (the H200 image)"; exit 2; }
glibc=$(ldd --version | head -1 | grep -o '[0-9]\+\.[0-9]\+$')
python3 -c "import sys; sys.exit(tuple(map(int, '$glibc'.split('.'))) < (2, 34))" \
  || { echo "sglang's wheel is manylinux_2_34: this machine's glibc is $glibc"; exit 2; }
if [ ! -d /tmp/site/sglang ] || [ ! -d /tmp/site/sgl_kernel ] || [ ! -d /tmp/site-sglang/transformers ]; then
  mkdir -p /tmp/chunks-sglang && cp -n "$C"/c*/part.* /tmp/chunks-sglang/ 2>/dev/null
  (cd /tmp/chunks-sglang && sha256sum -c --quiet "$C/dev/parts.sha256") \
    || { echo "chunks missing or corrupt (send every .carry-sglang/cNN first):"; ls -la /tmp/chunks-sglang; exit 3; }
  rm -rf /tmp/wheels-sglang && mkdir -p /tmp/wheels-sglang && cat /tmp/chunks-sglang/part.* | tar xf - -C /tmp/wheels-sglang \
    && rm -rf /tmp/chunks-sglang
  # wheels already in /tmp/site at the same version (the vLLM carry shares 41 of them) are left as they are
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels-sglang/*.whl 2>&1 \
    | grep -v "WARNING: Target directory" | tail -5
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-sglang /tmp/wheels-sglang/own/*.whl \
    2>&1 | tail -5
  rm -rf /tmp/wheels-sglang
fi
PYTHONPATH=/tmp/site-sglang:/tmp/site:${PYTHONPATH:-} python3 -c 'import sglang.srt.entrypoints.engine, sgl_kernel, torch_memory_saver, transformers; print("sglang", sglang.__version__, "installed in /tmp/site, transformers", transformers.__version__, "in /tmp/site-sglang")' \
  || { echo "sglang does not import from /tmp/site"; exit 4; }
