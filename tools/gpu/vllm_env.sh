# Sourced by the GPU scripts that run vLLM (h200_switch.sh, lora_h200.sh), from the project root: installs the
# vLLM carry of ../shared/tools/vllm-on-h200 (.carry/dev, once per machine) and the gearshift wheels (.whl/,
# tools/gpu/make_wheels.sh) under /tmp/site, and sets the environment vLLM runs in there.
if [ -d .carry/dev ] && [ ! -d /tmp/site/vllm ]; then
  bash .carry/dev/install.sh || exit 1
fi
if [ ! -d /tmp/site/gearshift ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 \
    | grep -v "WARNING: Target directory" | tail -3
fi
echo "gearshift from commit $(cat .whl/COMMIT 2>/dev/null)"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GEARSHIFT_CACHE=/tmp/gscache
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_CACHE_ROOT=/tmp/vllm_cache
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
quiet() { grep --line-buffered -v "Loading weights\|Writing model\|Loading safetensors\|it/s\]$\|^\s*$"; }
