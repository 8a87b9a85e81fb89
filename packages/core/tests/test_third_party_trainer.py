"""A third-party trainer on `ModuleTrainEngine` (ddp_trainer.py: torch DDP) keeps the train contract through
public extension points alone: the core's conformance suite, in one process and on two ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.conformance.util import private_overrides
from gearshift.module_train import ModuleTrainEngine
from gearshift.sharding import Sharding

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from ddp_trainer import DDPSharding, DDPTrainEngine, TestDDPTrain  # noqa: E402,F401  (the suite runs here too)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    """The engines here make a process group of one; taken down after the module, for the tests after it."""
    yield
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ and dist.is_initialized():
        dist.destroy_process_group()


def test_the_trainer_overrides_no_private_name():
    assert private_overrides(DDPTrainEngine, ModuleTrainEngine) == []
    assert private_overrides(DDPSharding, Sharding) == []

    class Sneaky(DDPTrainEngine):
        def _forward(self, batch, with_entropy):  # the check itself: this one is caught
            raise AssertionError

    assert private_overrides(Sneaky, ModuleTrainEngine) == ["_forward"]


def test_a_trainer_written_against_the_old_hooks_is_refused_naming_what_replaced_them():
    with pytest.raises(TypeError, match=r"_parallelize -> Sharding.parallelize.*pass a gearshift.sharding.Sharding"):
        class Old(ModuleTrainEngine):
            def _parallelize(self, model):
                return model


def test_the_conformance_suite_passes_on_two_ranks(gearshift_model, tmp_path):
    """Every test of the train suite on two processes under torchrun (gloo), gradients all-reduced by DDP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "--log_dir", str(tmp_path / "logs"), "--redirects", "3",
           "-m", "pytest", "ddp_trainer.py", "-p", "no:cacheprovider", "-q", "-rA", "-W", "ignore::UserWarning",
           "--gearshift-model", gearshift_model]
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    outputs = {p.parent.name: p.read_text() for p in sorted((tmp_path / "logs").glob("*/attempt_0/*/stdout.log"))}
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n" + "\n".join(o[-3000:] for o in outputs.values())
    assert sorted(outputs) == ["0", "1"], proc.stderr[-2000:]
    for rank, out in outputs.items():
        passed = [line for line in out.splitlines() if line.startswith("PASSED")]
        assert len(passed) == sum(1 for n in dir(TestDDPTrain) if n.startswith("test_")), f"rank {rank}:\n{out[-3000:]}"
        assert "FAILED" not in out and "SKIPPED" not in out, f"rank {rank}:\n{out[-3000:]}"
