"""Two ranks under torchrun (gloo, CPU): data-parallel replicas and a tensor-parallel pair, synced from shards."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(mode: str, model: str, cache: Path, logs: Path) -> dict[int, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "300"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--log_dir", str(logs), "--redirects", "3",
           str(HERE / "two_ranks.py"), mode, model, str(cache)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    outputs = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stdout.log")}
    errors = {int(p.parent.name): p.read_text()[-4000:] for p in logs.glob("*/attempt_0/*/stderr.log")}
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{errors}"
    results = {}
    for rank, out in outputs.items():
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results[rank] = json.loads(line.removeprefix("RESULT "))
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_two_ranks_generate_and_take_weights_from_a_sharded_trainer(mode, gearshift_model, vllm_cache_dir, tmp_path):
    results = run_two_ranks(mode, gearshift_model, vllm_cache_dir, tmp_path / "logs")
    for r in results.values():
        print(f"{mode} rank {r['rank']}: logprob diff vs transformers {r['diff_before']:.2g} before, "
              f"{r['diff_after']:.2g} after the sync")
        assert r["mesh"] == ("dp=2" if mode == "dp" else "tp=2") and r["spec_mesh"] == r["mesh"]
        # dp: each rank receives every weight whole; tp: each rank its slices (half of most weights)
        assert r["loaded_bytes"] == r["local_bytes"]
        assert r["local_bytes"] == r["spec_bytes"] if mode == "dp" else r["local_bytes"] < 0.75 * r["spec_bytes"]
        assert r["diff_before"] <= 1e-4 and r["diff_after"] <= 1e-4
        assert r["changed"] and r["restored"]
        assert r["threads"] == 1  # OMP_NUM_THREADS=1 in the launch, kept by the engine
    if mode == "dp":
        assert (results[0]["prompts"], results[1]["prompts"]) == (1, 2)  # shares of different sizes
    else:
        assert results[0]["tokens"] == results[1]["tokens"]
