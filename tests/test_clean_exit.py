"""`gearshift train` with the default engines (vllm + fsdp) ends without a traceback, run to its end or stopped
with Ctrl-C: the engines are closed while the process group they share still exists, not left to finalizers
at the interpreter's exit."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gearshift import registry


def test_a_run_with_the_default_engines_exits_without_a_traceback(gearshift_model, tmp_path):
    _needs_default_engines()
    out = tmp_path / "run"
    proc = subprocess.run(_train(gearshift_model, out, "run.steps=1"), cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "reward/mean: first step" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-4000:]


def test_ctrl_c_mid_run_says_where_the_run_stood_and_leaves_no_traceback(gearshift_model, tmp_path):
    _needs_default_engines()
    out = tmp_path / "run"
    proc = subprocess.Popen(_train(gearshift_model, out, "run.steps=500", "run.checkpoint_every=1"), cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, (stdout + stderr)[-4000:]
    assert "gearshift train: interrupted in step" in stderr or "gearshift train: interrupted after step" in stderr
    assert "the same command resumes there (run.resume=auto)" in stderr
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "Exception ignored" not in stderr, stderr[-4000:]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _needs_default_engines() -> None:
    if not (registry.ready("train", "fsdp") and registry.ready("rollout", "vllm")):
        pytest.skip("gearshift-fsdp and gearshift-vllm are needed")


def _train(model: str, out, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gearshift", "train", f"model.path={model}", "train.backend=fsdp",
            "rollout.backend=vllm", "run.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=3",
            f"run.output_dir={out}", "run.progress=false", "run.tensorboard=false", "run.plot=false", *overrides]


def test_ctrl_c_is_known_inside_the_errors_that_wrap_it():
    """torch's distributed checkpoint turns a KeyboardInterrupt raised while it writes (checkpoints every step,
    an fsdp trainer) into a CheckpointException: still Ctrl-C, not a failure with a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    from gearshift.rl.run import _ctrl_c

    assert _ctrl_c(KeyboardInterrupt())
    assert _ctrl_c(CheckpointException("save", {0: (KeyboardInterrupt(), None)}))
    assert not _ctrl_c(CheckpointException("save", {0: (OSError("disk full"), None)}))
    assert not _ctrl_c(ValueError("bad value"))
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise RuntimeError("stopped inside an engine") from inner
    except RuntimeError as outer:
        assert _ctrl_c(outer)
