"""Episodes through the whole RL loop on each installed rollout backend: tools, environments and masks."""

import os

import pytest

from gearshift import Trainer, registry

FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_episodes_train_on_the_rollout_backend(backend, gearshift_model, tmp_path):
    if not any(b.name == backend and b.ready for b in registry.list_backends("rollout")):
        if os.environ.get("CI") and backend == "vllm":
            pytest.fail("gearshift-vllm not installed: tools/install.sh installs it")
        pytest.skip(f"gearshift-{backend} not installed")
    options = {"cache_dir": str(tmp_path / "cache"), "kv_cache_bytes": 64 * 2**20} if backend == "vllm" else {}
    history = Trainer(model=gearshift_model, data={"task": "guess"}, agent={"max_turns": 3, "max_tokens": 24},
                      rollout={"backend": backend, "n": 2, "max_tokens": 3, "options": options},
                      train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path / "run"), **FAST}).train()
    assert all(m["agent/turns_mean"] > 1 and m["agent/model_token_share"] < 1 for m in history)
    assert history[0]["mismatch/logprob_max"] < 1e-4  # the environment's tokens (logprob 0) are masked out


def _readme_calc_command() -> list[str]:
    """The README's `data.task=calc` training command, word by word."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines = [line.strip() for line in readme.splitlines() if line.strip().startswith("gearshift train data.task=calc")]
    assert len(lines) == 1, lines
    return lines[0].split()


@pytest.mark.slow
def test_the_readme_calc_command_learns_to_read_the_calculator(tmp_path):
    """The README's calc run end to end, its task model built from scratch: 0.9 or more over its last ten steps
    (about 10 minutes on one free CPU core: the warm-up, then 200 steps)."""
    import statistics
    import subprocess
    import sys

    from gearshift.rl.metrics import read_jsonl

    words = _readme_calc_command()
    assert words[:2] == ["gearshift", "train"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GEARSHIFT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "gearshift", *words[1:], f"run.output_dir={tmp_path / 'run'}",
                           "run.progress=false", "run.plot=false", "run.tensorboard=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rewards = [m["reward/mean"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m]
    assert len(rewards) == 200
    assert statistics.fmean(rewards[-10:]) >= 0.9, rewards
