"""`gearshift train` with the default engines (vllm + fsdp) ends without a traceback: the engines are closed
while the process group they share still exists, not left to finalizers at the interpreter's exit."""

import os
import subprocess
import sys

import pytest

from gearshift import registry



def test_a_run_with_the_default_engines_exits_without_a_traceback(gearshift_model, tmp_path):
    if not (registry.ready("train", "fsdp") and registry.ready("rollout", "vllm")):
        pytest.skip("gearshift-fsdp and gearshift-vllm are needed")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearshift", "train", f"model.path={gearshift_model}", "train.backend=fsdp",
           "rollout.backend=vllm", "run.steps=1", "run.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3",
           f"run.output_dir={out}", "run.progress=false", "run.tensorboard=false", "run.plot=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "reward/mean: first step" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
