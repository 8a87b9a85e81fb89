"""The RL loop under torchrun: 2 gloo ranks, fsdp training + one hf replica per rank, with a checkpoint."""

import json
import os
import socket
import subprocess
import sys

import pytest

from gearshift import registry
from gearshift.rl.metrics import read_jsonl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grpo_on_two_ranks(gearshift_model, tmp_path):
    if not registry.ready("train", "fsdp"):
        pytest.skip("gearshift-fsdp not installed")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "gearshift", "train", f"model.path={gearshift_model}", "train.backend=fsdp", "rollout.backend=hf",
           "run.steps=3", "run.prompts_per_step=4", "rollout.n=2", "rollout.max_tokens=3", "run.checkpoint_every=2",
           f"run.output_dir={out}", "run.progress=false", "run.tensorboard=false", "run.plot=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")  # rank 0 alone writes it
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/max"] >= r["reward/mean"] >= r["reward/min"] for r in rows)
    assert (out / "checkpoints" / "step_000002" / "COMPLETE").exists()
    assert json.dumps(rows)  # plain numbers only


def test_a_rank_whose_samples_are_all_dropped_does_not_hang_the_others(gearshift_model, tmp_path):
    if not registry.ready("train", "fsdp"):
        pytest.skip("gearshift-fsdp not installed")
    reward = tmp_path / "drop_on_rank1.py"
    reward.write_text("import os\n\ndef score(completion, **row):\n"
                      "    return None if os.environ.get('RANK') == '1' else float(len(completion))\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "gearshift", "train", f"model.path={gearshift_model}", "train.backend=fsdp", "rollout.backend=hf",
           f"reward.fn={reward}:score", "run.steps=2", "run.prompts_per_step=4", "rollout.n=2",
           "rollout.max_tokens=3", "run.checkpoint_every=0", f"run.output_dir={out}", "run.progress=false",
           "run.tensorboard=false", "run.plot=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GEARSHIFT_DIST_TIMEOUT": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/skipped"] == 1.0 and "train/pg_loss" not in r for r in rows)
    assert "not trained" in proc.stdout


@pytest.mark.parametrize("layout", [  # the dp x tp layout stays fast: it meets a tp rollout engine and dp ranks
    pytest.param(("train.mesh=tp=2", "rollout.mesh=tp=2"), id="train.mesh=tp=2 rollout.mesh=tp=2",
                 marks=pytest.mark.slow),
    pytest.param(("train.mesh=sp=2",), id="train.mesh=sp=2", marks=pytest.mark.slow),
    pytest.param(("train.mesh=dp=2", "rollout.mesh=tp=2"), id="train.mesh=dp=2 rollout.mesh=tp=2")])
def test_grpo_with_tensor_and_sequence_parallelism(layout, tmp_path):
    """tp and sp peers get the same prompts and samples; a tp rollout engine's ranks generate together."""
    if not registry.ready("train", "fsdp"):
        pytest.skip("gearshift-fsdp not installed")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "gearshift", "train", "model.path=tiny4h", "train.backend=fsdp", "rollout.backend=hf", *layout,
           "run.steps=2", "run.prompts_per_step=4", "rollout.n=2", "rollout.max_tokens=3", "rollout.logprobs=always",
           "run.checkpoint_every=2",
           f"run.output_dir={out}", "run.progress=false", "run.tensorboard=false", "run.plot=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GEARSHIFT_CACHE": str(tmp_path / "cache"),
           "GEARSHIFT_DIST_TIMEOUT": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/skipped"] == 0.0 for r in rows)
    assert all(r["mismatch/logprob_max"] < 1e-4 for r in rows)  # the rollout engine serves the trainer's weights
    assert (out / "checkpoints" / "step_000002" / "COMPLETE").exists()
