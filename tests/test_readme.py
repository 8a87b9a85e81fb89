"""Every command README.md tells people to run is run here or by CI, so the README cannot drift from the code.

`tools/readme_commands.py` reads the commands out of the README as written. Each must appear in `HOW` below,
which says what runs it: CI (`.ci/run`: the two commands for a fresh machine), this file (as written, or
`gearshift train ... --check` for a whole run, or the CLI's parser for a third party's own backend), a named
test that runs it, or, for a GPU script or an environment's setup script, a syntax check here. A command the README gains without an entry
fails `test_every_readme_command_is_run_somewhere`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tools" / "readme_commands.py")
readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme)
COMMANDS = readme.all_commands((ROOT / "README.md").read_text())

#: command as the README writes it -> (what runs it, detail)
HOW: dict[str, tuple[str, str]] = {
    "tools/install.sh && .venv/bin/gearshift train": ("ci", ".ci/run"),
    "tools/install.sh --test && .venv/bin/python -m pytest": ("ci", ".ci/run"),
    "tools/install.sh": ("ci", ".ci/run"),
    "tools/install_sglang.sh": ("ci", "tools/install.sh runs it"),
    "gearshift train": ("ci", ".ci/run"),
    "gearshift train my.yaml algorithm.name=ppo rollout.backend=vllm train.backend=fsdp run.steps=200": ("check", ""),
    "gearshift train --print-config": ("run", "# The policy's learning rate; null: the algorithm's own"),
    "gearshift train --check": ("run", "the configuration can run"),
    "gearshift backends vllm": ("run", "rollout backend 'vllm'"),
    "gearshift backends": ("run", "reshard"),
    "gearshift env": ("run", "backend contract"),
    "pip install 'gearshift[ray]'": ("extra", "ray"),
    "pip install 'gearshift[lora]'": ("extra", "peft"),
    "pip install 'gearshift[conformance]'": ("extra", "pytest"),
    "gearshift train run.placement=split": ("check", ""),
    "gearshift train run.placement=split algorithm.off_policy_steps=1 algorithm.rollout_correction=tis": ("check", ""),
    "gearshift train run.placement=split run.pools.train=2 run.pools.rollout=2 train.backend=fsdp": ("check", ""),
    "gearshift train my.yaml run.placement=split run.ray_address=auto run.pools.train=8 run.pools.rollout=8 "
    "model.path=/shared/models/m run.output_dir=/shared/runs/r": ("parse", "a cluster's shared folders"),
    "gearshift train algorithm.name=ppo run.seed=3": ("check", ""),
    "gearshift train data.task=calc model.path=small-calc rollout.backend=hf train.backend=torch run.steps=200 "
    "run.prompts_per_step=16 rollout.n=16 rollout.max_tokens=20 agent.max_tokens=48 agent.max_turns=3 "
    "train.lr=1e-4": ("check", ""),
    "python tools/calc_warmup.py --answers shuffled --out DIR": ("help", ""),
    "python tools/compile_matrix.py": ("help", ""),
    "gearshift train data.task=guess rollout.max_tokens=3 agent.max_turns=4 agent.max_tokens=32": ("check", ""),
    "gearshift bench step rollout.backend=hf train.backend=torch --steps 6": ("run", "% of the step"),
    "gearshift bench switch --train torch --rollout hf --model bench100m": ("run", "naive"),
    "gearshift bench rollout --backends hf,vllm": ("run", "vllm"),
    "gearshift bench train --backends torch,fsdp": ("run", "fsdp"),
    "gearshift bench switch --share off": ("parse", "an option of the bench command above"),
    "gearshift bench step": ("parse", "the bench command above, named in the TRL comparison"),
    "gearshift bench switch --lora-r 8": ("parse", "an option of the bench command above"),
    "torchrun --nproc_per_node 2 -m gearshift bench train --backends fsdp --seq-len 2048 --mesh dp=2 --mesh sp=2": (
        "test", "packages/backend-fsdp/tests/test_parallel.py"
        "::test_sequence_parallelism_splits_the_activations_of_a_long_sequence"),
    "torchrun --nproc_per_node 2 -m gearshift bench switch --train fsdp --rollout vllm --model small "
    "--rollout-options '{\"mesh\": \"tp=2\"}' --against-whole": (
        "test", "packages/backend-vllm/tests/test_tp_slices.py"
        "::test_bench_switch_against_whole_shows_each_rank_receives_half"),
    "gearshift bench train --mesh dp=2 --mesh sp=2": ("parse", "the torchrun command's options, below"),
    "gearshift conformance --train fsdp --rollout vllm": ("test", "tests/test_pairs.py::test_conformance_of_pair"),
    "gearshift backends myengine": ("parse", "a third party's backend"),
    "gearshift conformance --rollout myengine --train torch": ("parse", "a third party's backend"),
    "pip install -e .": ("third-party", "a backend's own folder"),
    "python tools/rl_compare.py ppo": ("help", ""),
    "python tools/arch_matrix.py": ("help", ""),
    "python tools/trl_compare.py": ("help", ""),
    "python tools/trl_compare.py --engines hf": ("help", ""),
    "bash tools/trl_env.sh": ("script", "tools/trl_env.sh"),
    "gearshift train run.seed=0": ("check", ""),
    "tools/gpu/trl_h200/make_wheels.sh": ("script", "tools/gpu/trl_h200/make_wheels.sh"),
    "bash tools/gpu/trl_h200.sh check|0.5b|7b|summary": ("gpu", "tools/gpu/trl_h200.sh"),
    "python tools/bench_matrix.py --model bench100m": ("help", ""),
    "python tools/simulate_plan.py": ("run", "naive"),
    "python -m pytest tests/test_soak.py --runslow -s": ("test", "tests/test_soak.py::test_switches_do_not_leak_or_drift"),
    "bash tools/gpu/lora_h200.sh bench rollout grpo": ("gpu", "tools/gpu/lora_h200.sh"),
    "bash tools/gpu/h200_switch.sh switch|grpo|deepspeed": ("gpu", "tools/gpu/h200_switch.sh"),
    "bash tools/gpu/deepspeed_h200.sh conformance": ("gpu", "tools/gpu/deepspeed_h200.sh"),
    "tools/gpu/split_ray.sh": ("gpu", "tools/gpu/split_ray.sh"),
    "bash tools/gpu/h200_realistic.sh build": ("gpu", "tools/gpu/h200_realistic.sh"),
    "bash tools/gpu/train_phase.sh": ("gpu", "tools/gpu/train_phase.sh"),
    "bash tools/gpu/h200_realistic.sh profile": ("gpu", "tools/gpu/h200_realistic.sh"),
    "bash tools/gpu/h200_realistic.sh moe": ("gpu", "tools/gpu/h200_realistic.sh"),
    "CELLS=7b-256-fsdp-auto,0.5b-1024-fsdp-forced STEPS=20 bash tools/gpu/h200_realistic.sh scenario": (
        "gpu", "tools/gpu/h200_realistic.sh"),
    "python tools/gpu/scenario_table.py": ("run", "7b-256-fsdp-auto"),
    "python tools/gpu/scenario_table.py --missing": ("run", "cells finished 20 steps"),
    "python3 tools/gpu/check_fits.py --model qwen2-7b": ("help", ""),
    "bash tools/gpu/h200_sglang.sh conformance bench scenario": ("gpu", "tools/gpu/h200_sglang.sh"),
    "tools/gpu/background.sh": ("test", "tests/test_background_jobs.py"
                                "::test_a_job_runs_on_after_its_call_and_its_exit_code_and_output_are_kept"),
}


def test_every_readme_command_is_run_somewhere():
    missing = [c for c in COMMANDS if c not in HOW]
    assert not missing, f"README commands nothing runs: {missing}; add each to HOW in {__file__}"
    stale = [c for c in HOW if c not in COMMANDS]
    assert not stale, f"HOW lists commands the README no longer has: {stale}"
    stale_slow = sorted(SLOW_RUNS - set(_by("run")))
    assert not stale_slow, f"SLOW_RUNS lists commands HOW does not run: {stale_slow}"


def test_ci_runs_the_two_fresh_machine_commands_as_written():
    fresh = readme.fresh((ROOT / "README.md").read_text())
    assert fresh == ["tools/install.sh && .venv/bin/gearshift train",
                     "tools/install.sh --test && .venv/bin/python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tools/readme_commands.py fresh" in ci and '"${commands[0]}"' in ci and '"${commands[1]}"' in ci


def _by(kind):
    return [c for c in COMMANDS if HOW.get(c, ("",))[0] == kind]


def _gearshift(cmd: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    args = shlex.split(cmd)
    assert args[0] == "gearshift"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gearshift", *args[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", _by("check"))
def test_a_training_command_is_a_configuration_that_can_run(cmd, tmp_path):
    (tmp_path / "my.yaml").write_text("run:\n  steps: 10\n")  # the README's my.yaml: any config file
    run = _gearshift(cmd + " --check", tmp_path)
    assert run.returncode == 0 and "the configuration can run" in run.stdout, run.stdout + run.stderr


#: commands that run 80-140 s on 2 cores: run with --runslow
SLOW_RUNS = {"gearshift bench rollout --backends hf,vllm", "python tools/simulate_plan.py"}


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_RUNS else [])
                                 for c in _by("run")])
def test_a_command_runs_as_written(cmd, tmp_path):
    expect = HOW[cmd][1]
    if cmd.startswith("python "):
        args = shlex.split(cmd)
        run = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    else:
        run = _gearshift(cmd, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert expect in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("cmd", _by("parse"))
def test_a_command_for_another_machine_parses(cmd):
    from gearshift.cli import build_parser

    args = shlex.split(cmd)[1:]
    build_parser().parse_args(args)  # exits (SystemExit) on an option or command that does not exist


@pytest.mark.parametrize("cmd", _by("help"))
def test_a_long_tool_starts(cmd):
    args = shlex.split(cmd)
    run = subprocess.run([sys.executable, args[1], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr


@pytest.mark.parametrize("cmd", _by("extra"))
def test_an_extra_exists_and_the_install_brings_it(cmd):
    import tomllib

    extra = cmd.split("[")[1].split("]")[0]
    extras = tomllib.loads((ROOT / "packages/core/pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras, f"gearshift has no extra {extra!r}"
    assert importlib.util.find_spec(HOW[cmd][1]) is not None, f"tools/install.sh did not install {HOW[cmd][1]}"
    assert extra in (ROOT / "tools/install.sh").read_text() or extra == "test"


@pytest.mark.parametrize("cmd", _by("test"))
def test_a_named_test_runs_it(cmd):
    path, _, name = HOW[cmd][1].partition("::")
    tree = ast.parse((ROOT / path).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{HOW[cmd][1]} is gone"


@pytest.mark.parametrize("cmd", _by("gpu") + _by("script"))
def test_a_gpu_or_setup_script_parses(cmd):
    script = ROOT / HOW[cmd][1]
    assert script.is_file()
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
