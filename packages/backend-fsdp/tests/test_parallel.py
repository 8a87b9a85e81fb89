"""Tensor and sequence parallelism compute the data-parallel step: loss and every gradient within fp32 round-off.

Each layout runs under torchrun (gloo) in parallel_ranks.py, which compares every
rank's result with the same step in plain transformers in one process: two
processes for tp=2 and sp=2 (dp=1), four for dp=2 x tp=2 and dp=2 x sp=2.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: a sum of a few hundred fp32 products, added up in another order: a few ulps of the largest gradient
GRAD_ATOL = 1e-6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, model: str, meshes: list[str], logs: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "--log_dir", str(logs), "--redirects", "3",
           str(HERE / "parallel_ranks.py"), model, *meshes]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    errors = {p.parent.name: p.read_text()[-3000:] for p in logs.glob("*/attempt_0/*/stderr.log")}
    assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{errors}"
    results = [json.loads(line.removeprefix("RESULT ")) for p in logs.glob("*/attempt_0/*/stdout.log")
               for line in p.read_text().splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2 * nproc * len(meshes)  # each with padded rows and without
    return results


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gearshift.models import resolve_model

    return resolve_model("tiny4h", cache_dir=tmp_path_factory.mktemp("models"))


def check(results: list[dict]) -> None:
    for r in results:
        print(f"{r['mesh']}{'' if r['padded'] else ' (no padding)'} rank {r['rank']}: loss {r['loss']:.7f} "
              f"(one process {r['ref_loss']:.7f}), "
              f"largest gradient difference {r['grad_diff']:.2g} of gradients up to {r['grad_scale']:.2g}")
        assert r["same_names"] and r["shapes_ok"] and r["slices_ok"], r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6, abs=0)
        assert r["grad_diff"] <= GRAD_ATOL
        # tp cuts the 7 projections of each of the 2 layers (and the q, k, v biases): 20 weights
        assert r["tp_sharded"] == (20 if "tp" in r["mesh"] else 0), r["placements"]


def test_tp_and_sp_on_two_ranks_equal_the_one_process_step(model, tmp_path):
    check(run(2, model, ["tp=2", "sp=2"], tmp_path / "logs"))


def test_dp_by_tp_and_dp_by_sp_on_four_ranks_equal_the_one_process_step(model, tmp_path):
    check(run(4, model, ["dp=2,tp=2", "dp=2,sp=2"], tmp_path / "logs"))


def test_sequence_parallelism_splits_the_activations_of_a_long_sequence(model, tmp_path):
    """`gearshift bench train` with dp=2 and sp=2 in one run: each rank holds whole sequences, or half of each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEARSHIFT_DIST_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "gearshift", "bench", "train", "--backends", "fsdp",
           "--model", model, "--batch-size", "2", "--seq-len", "1024", "--steps", "1", "--mesh", "dp=2",
           "--mesh", "sp=2", "--options", json.dumps({"fsdp": {"param_dtype": "float32"}})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("fsdp")]
    header = next(line.split() for line in proc.stdout.splitlines() if line.strip().startswith("backend"))
    peak = {row[header.index("mesh")]: float(row[header.index("step_peak_mb")]) for row in lines}
    print(f"step peak per rank: dp=2 {peak['dp=2']:.1f} MB, sp=2 {peak['sp=2']:.1f} MB "
          f"({peak['sp=2'] / peak['dp=2']:.2f}x)")
    assert peak["sp=2"] < 0.75 * peak["dp=2"]
