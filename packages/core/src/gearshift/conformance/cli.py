"""`gearshift conformance`: the suite for any installed pair, third-party plugins included."""

from __future__ import annotations

import argparse
import json

from ..options import json_object


def add_conformance_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", help="train backend to check (its contracts, and the pair's with --rollout)")
    p.add_argument("--rollout", help="rollout backend to check")
    p.add_argument("--model", default="tiny", help="model folder or preset (default tiny; fp32)")
    p.add_argument("--train-options", type=json_object, default="{}", help="JSON options for the train engine")
    p.add_argument("--rollout-options", type=json_object, default="{}", help="JSON options for the rollout engine")
    p.add_argument("--atol", type=float, help="log-probability tolerance (default: the fp32 values of the suite)")
    p.add_argument("--budget", help="override the switch budgets, e.g. k=2,m=3 (see gearshift/budgets.yaml)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after '--': arguments for pytest (e.g. -x -k sync)")


def conformance_command(args: argparse.Namespace) -> int:
    import pytest  # not installed: `gearshift` says to install gearshift[conformance]

    if not args.train and not args.rollout:
        raise ValueError("name a backend: --train NAME and/or --rollout NAME (see 'gearshift backends')")
    from .. import registry, rl  # noqa: F401 - rl registers the task models ('small-add', ...) with gearshift.models
    from ..models import known_model, unknown_model

    for kind, name in (("train", args.train), ("rollout", args.rollout)):
        if name:
            registry.load(kind, name)  # a clear error now rather than one per test
    if not known_model(args.model):
        raise ValueError(unknown_model(args.model))
    selected = {"train": ["TestTrain"], "rollout": ["TestRollout"]}
    classes = (selected["train"] if args.train else []) + (selected["rollout"] if args.rollout else [])
    if args.train and args.rollout:
        classes.append("TestPair")
    options = {"train": args.train_options, "rollout": args.rollout_options}
    argv = ["-p", "gearshift.conformance.plugin", "--pyargs", "gearshift.conformance.by_name",
            "-k", " or ".join(classes),
            "--gearshift-model", args.model, "--gearshift-options", json.dumps(options), "-p", "no:cacheprovider",
            "-q", "-rxXs"]
    if args.train:
        argv += ["--gearshift-train", args.train]
    if args.rollout:
        argv += ["--gearshift-rollout", args.rollout]
    if args.atol is not None:
        argv += ["--gearshift-atol", str(args.atol)]
    if args.budget:
        argv += ["--gearshift-budget", args.budget]
    extra = [a for a in args.pytest_args if a != "--"]
    return int(pytest.main(argv + extra))
