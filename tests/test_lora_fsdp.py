"""LoRA on FSDP over two ranks (gloo): the conformance suite with adapters, and the sharded merge and adapter file."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift import registry

ROOT = Path(__file__).resolve().parent.parent
LORA = {"lora_r": 4, "lora_alpha": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two ranks of LoRA on FSDP: ~140 s on 2 cores; one rank's LoRA runs in the fast set
def test_lora_on_fsdp_with_two_ranks(tmp_path):
    pytest.importorskip("peft")
    if not registry.ready("train", "fsdp"):
        pytest.skip("gearshift-fsdp not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "120",
           "GEARSHIFT_FSDP_OPTIONS": json.dumps(LORA)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--log_dir", str(tmp_path / "logs"), "--redirects", "3",
           "-m", "pytest", "packages/backend-fsdp/tests/test_conformance.py", "tests/lora_fsdp_ranks.py",
           "-p", "no:cacheprovider", "-q", "-rA", "-W", "ignore::UserWarning",
           # as the fsdp package's own two-rank run: the stream must not lose to the file round trip
           "--gearshift-budget", "m=1.0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    outputs = {int(p.parent.name): p.read_text() for p in sorted((tmp_path / "logs").glob("*/attempt_0/*/stdout.log"))}
    assert sorted(outputs) == [0, 1], proc.stderr[-3000:]
    for rank, out in outputs.items():
        assert proc.returncode == 0, f"rank {rank}:\n{out[-6000:]}\n{proc.stderr[-3000:]}"
        summary = out.strip().splitlines()[-1]
        assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error", summary), summary
        for name in ("test_sharded_adapters_export_the_merged_weights",
                     "test_gather_whole_with_uneven_and_empty_shards",
                     "test_adapter_written_by_two_ranks_loads_with_peft",
                     "test_checkpoint_holds_the_adapters_only_and_resumes",
                     "TestFSDPWithHFRollout::test_after_sync_rollout_logprobs_agree_with_training",
                     "TestFSDPWithHFRollout::test_a_train_step_reaches_the_rollout_engine",
                     "TestFSDPTrain::test_save_load_round_trip"):
            assert re.search(rf"^PASSED \S*{re.escape(name)}", out, re.M), f"rank {rank} did not pass {name}"
