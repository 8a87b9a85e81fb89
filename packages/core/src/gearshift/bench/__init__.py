"""Benchmarks: switch latency beside its baselines, rollout tokens/s, train steps/s, tokens/s and padding, an RL
step's phases (`gearshift bench switch|rollout|train|step`).

Every figure is measured in the same run as the baselines it is compared with.
One module per benchmark (`switch`, `rollout`, `train`, `step`), each with its
measuring function, its arguments and its command; `report` prints and plots;
`timing` is what they measure with.
"""

from __future__ import annotations

import argparse

from .report import SwitchBench, print_rows
from .rollout import add_rollout_arguments, bench_rollout, measure_rollout
from .step import STEP_PHASES, add_step_arguments, bench_step, measure_steps
from .switch import OwnLoad, add_switch_arguments, bench_switch, measure_pair, measure_switch, switch_settings
from .train import add_train_arguments, bench_train, measure_train, step_peak_bytes, train_batch

COMMANDS = {"step": bench_step, "switch": bench_switch, "rollout": bench_rollout, "train": bench_train}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    add_step_arguments(sub.add_parser("step", help="an RL step's phases (rollout, reward, old logprobs, switch, "
                                                   "train, the loop's own), medians over N steps of a job"))
    add_switch_arguments(sub.add_parser("switch", help="switch latency of a pair beside naive, copy and engine-load "
                                                       "baselines"))
    add_rollout_arguments(sub.add_parser("rollout", help="generated tokens/s of rollout backends, side by side"))
    add_train_arguments(sub.add_parser("train", help="train steps/s, tokens/s and padding of train backends, "
                                                     "side by side"))


def bench_command(args: argparse.Namespace) -> int:
    return COMMANDS[args.what](args)


__all__ = ["OwnLoad", "STEP_PHASES", "SwitchBench", "add_bench_arguments", "bench_command", "measure_pair",
           "measure_rollout", "measure_steps", "measure_switch", "measure_train", "print_rows", "step_peak_bytes",
           "switch_settings", "train_batch"]
