#!/usr/bin/env python3
"""Build a calc task model with a chosen warm-up, for comparing warm-ups (docs/agent-calc.md).

    python tools/calc_warmup.py --answers near --out /tmp/small-calc-near
    gearshift train data.task=calc model.path=/tmp/small-calc-near ...

`gearshift train data.task=calc` builds `small-calc` itself with `--answers length` (final answers drawn at
random from the task's answers with as many digits as the tool's, so the model starts at chance); `--answers
shuffled` draws them from all the task's answers (the length, too, left to RL); `--answers near` gives the
tool's answer with one digit changed, a start above chance. The same preset, task rows and seed as
`build_task_model`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", choices=("near", "length", "shuffled"), default="length")
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    from gearshift.rl.tasks import make_task
    from gearshift.rl.warmup import build_model, tool_warmup

    base = build_model(args.out / "base", preset=args.preset, seed=args.seed)
    rows = make_task("calc", 2000, seed=args.seed + 1)
    tool_warmup(base, args.out, rows, seed=args.seed, answers=args.answers)
    print(f"built {args.out} ({args.preset}, {args.answers} answers, seed {args.seed})")


if __name__ == "__main__":
    main()
