"""The RL loop with `train.backend=deepspeed`, as a user runs it: GRPO under torchrun with two ranks, and
(slow: two runs) PPO with a critic in one process, resumed from its checkpoint."""

import json
import os
import socket
import subprocess
import sys

import pytest
from gearshift.rl.metrics import read_jsonl

LOOP = ["train.backend=deepspeed", "rollout.backend=hf", "run.prompts_per_step=4", "rollout.n=2",
        "rollout.max_tokens=3", "run.progress=false", "run.tensorboard=false", "run.plot=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GEARSHIFT_DIST_TIMEOUT": "300"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="launches its own runs")
def test_ppo_with_a_critic_checkpoints_and_resumes(gearshift_model, tmp_path):
    out = tmp_path / "ppo"
    base = [sys.executable, "-m", "gearshift", "train", f"model.path={gearshift_model}", *LOOP,
            "algorithm.name=ppo", "run.checkpoint_every=2", f"run.output_dir={out}"]
    run([*base, "run.steps=2"], tmp_path)
    checkpoint = out / "checkpoints" / "step_000002"
    assert (checkpoint / "COMPLETE").exists()
    assert (checkpoint / "policy" / "gearshift-deepspeed.json").exists()  # DeepSpeed's own checkpoints
    assert (checkpoint / "critic" / "gearshift-deepspeed.json").exists()
    proc = run([*base, "run.steps=3"], tmp_path)
    assert "resumed from" in proc.stdout + proc.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("train/critic/vf_loss" in r and r["train/critic/grad_norm"] >= 0 for r in rows)


@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="launches its own runs")
def test_grpo_on_two_ranks(gearshift_model, tmp_path):
    out = tmp_path / "grpo"
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "gearshift", "train", f"model.path={gearshift_model}", *LOOP,
         "run.steps=3", "run.checkpoint_every=2", f"run.output_dir={out}"], tmp_path)
    rows = read_jsonl(out / "metrics.jsonl")  # rank 0 alone writes it
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/max"] >= r["reward/mean"] >= r["reward/min"] for r in rows)
    assert (out / "checkpoints" / "step_000002" / "COMPLETE").exists()
    meta = json.loads((out / "checkpoints" / "step_000002" / "policy" / "gearshift-deepspeed.json").read_text())
    assert meta == {"dp": 2, "zero_stage": 3, "trainable_only": False}
