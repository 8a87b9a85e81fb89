"""The conformance suite and the sharding and option checks again, with two processes under torchrun (gloo).

One launch for all of them: a torchrun start costs seconds. Then a checkpoint
the two processes wrote is resumed here, in one.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll

from gearshift_fsdp.engine import FSDPTrainEngine

HERE = Path(__file__).parent
MODULES = ["test_conformance.py", "test_sharding.py", "test_options.py"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Run the modules on 2 ranks; returns each rank's pytest output and the folder the run left behind."""
    root = tmp_path_factory.mktemp("two-processes")
    handoff = root / "handoff"
    handoff.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_FSDP_HANDOFF": str(handoff),
           "GEARSHIFT_DIST_TIMEOUT": "300"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--log_dir", str(root / "logs"), "--redirects", "3",
           "-m", "pytest", *MODULES, "-p", "no:cacheprovider", "-q", "-s", "-rA", "-W", "ignore::UserWarning",
           # With two ranks both resharders first move the same shards point to point (one message per
           # weight); the naive one then adds a file of the suite's 0.4 MB model, a few ms. Measured
           # naive/sync ratios on a busy 2-core machine: 1.3-2.4, so the default m=2 measures noise.
           # It still must not be slower than the file round trip.
           "--gearshift-budget", "m=1.0"]
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=1200)
    outputs = {int(p.parent.name): p.read_text() for p in sorted((root / "logs").glob("*/attempt_0/*/stdout.log"))}
    return proc, outputs, handoff


def test_every_check_passes_on_both_ranks(two_process_run):
    proc, outputs, _ = two_process_run
    assert sorted(outputs) == [0, 1], proc.stderr[-3000:]
    for rank, out in outputs.items():
        assert proc.returncode == 0, f"rank {rank}:\n{out[-6000:]}\n{proc.stderr[-3000:]}"
        summary = out.strip().splitlines()[-1]
        assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error|skipped|xfail", summary), summary
        for name in ("TestFSDPTrain::test_forward_logprobs_match_transformers",
                     "TestFSDPWithHFRollout::test_after_sync_rollout_logprobs_agree_with_training",
                     "test_plan_to_hf_rollout_sends_point_to_point", "test_export_peak_memory_is_one_bucket",
                     "test_hybrid_sharding_trains_exactly_like_plain_sharding"):
            assert re.search(rf"^PASSED \S*{re.escape(name)}", out, re.M), f"rank {rank} did not pass {name}"
    for line in outputs[0].splitlines():  # the figures, for the record
        if "FIGURE" in line or "max abs diff" in line:
            print(line)


def test_a_two_process_checkpoint_resumes_in_one(two_process_run, gearshift_model):
    _, _, handoff = two_process_run
    expected = torch.load(handoff / "expected.pt", weights_only=True)
    engine = FSDPTrainEngine(gearshift_model, lr=1e-2, param_dtype="float32")
    engine.load(str(handoff / "ckpt"))
    assert_same(full_weights(engine), expected["weights"])
    assert engine.train_step(fixed_batch(), nll)["loss"] == pytest.approx(expected["next_loss"], rel=1e-5)
