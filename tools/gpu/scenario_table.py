#!/usr/bin/env python3
"""Every GRPO cell measured so far, one Markdown table: the scenario JSONs under benchmarks/results.

    python3 tools/gpu/scenario_table.py                   the latest run of each cell on each device
    python3 tools/gpu/scenario_table.py --all             every run, oldest first
    python3 tools/gpu/scenario_table.py --missing         the cells of the scenario's matrix no run has finished

A results folder is named `<date>-<device>[-what]` (2026-12-05-h100-realistic): the date and the device (h100,
h200) come from it. Each `scenario*.json` in it is what tools/gpu/grpo_scenario.py wrote (`--rollout` and the
cell's fields say the engines). Medians are over the steps after the first two, as the scenario prints them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FOLDER = re.compile(r"^(\d{4}-\d{2}-\d{2})-(h100|h200)")
HEAD = ("date", "device", "cell", "rollout", "steps", "step s", "rollout s", "train s", "both switches",
        "offload (1st / steady)", "moved GB", "rollout slept", "peak GB", "micro-batches", "tokens/s")


def runs(root: Path = ROOT) -> list[dict]:
    """Every cell of every scenario JSON under `root`, with its date and device, oldest first."""
    found = []
    for path in sorted(root.glob("*/scenario*.json")):
        match = FOLDER.match(path.parent.name)
        if not match:
            continue
        try:
            cells = json.loads(path.read_text())["cells"]
        except (ValueError, KeyError, TypeError) as e:
            print(f"skipped {path}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        for cell in cells:
            found.append({**{k: v for k, v in cell.items() if k != "per_step"}, "date": match.group(1),
                          "device": match.group(2), "source": str(path.relative_to(root))})
    return sorted(found, key=lambda r: r["date"])


def latest(rows: list[dict]) -> list[dict]:
    """The last run of each (cell, rollout backend, device)."""
    last: dict[tuple, dict] = {}
    for r in rows:
        last[(r["cell"], r.get("rollout", "vllm"), r["device"])] = r
    return sorted(last.values(), key=lambda r: (r["device"], r["cell"], r.get("rollout", "vllm")))


#: the scenario's matrix (issue: every cell to its 20th step with vLLM rollout): model x answer tokens x trainer x offload
MATRIX = [f"{m}-{t}-{tr}-{o}" for m in ("0.5b", "1.5b", "7b") for t in (256, 1024) for tr in ("fsdp", "deepspeed")
          for o in ("auto", "forced")]


def missing(rows: list[dict], steps: int = 20, rollout: str = "vllm") -> list[tuple[str, str]]:
    """The matrix's cells no run has finished to `steps` with `rollout`, each with its best run so far."""
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("rollout", "vllm") == rollout and r["steps"] >= best.get(r["cell"], {"steps": -1})["steps"]:
            best[r["cell"]] = r
    left = []
    for cell in MATRIX:
        r = best.get(cell)
        if r is None:
            left.append((cell, "never run"))
        elif r.get("exit") != 0 or r["steps"] < steps:
            left.append((cell, f"{r['steps']} of {steps} ({ended(r)}), {r['date']} {r['device'].upper()}"))
    return left


def ended(r: dict) -> str:
    """Why a run stopped short: the time budget, stopped otherwise (terminated, a limit around the script),
    failed, or fewer steps asked."""
    if r.get("exit") == 124:
        error = r.get("error") or "stopped at the time budget"
        return "budget" if error.startswith("stopped at the time budget") else "stopped"
    return "failed" if r.get("exit") else "fewer asked"


def _f(v, spec=".2f", unit=""):
    return "-" if v is None else f"{format(v, spec)}{unit}"


def row(r: dict) -> str:
    finished = r["steps"] if r.get("exit") == 0 else f"{r['steps']} ({ended(r)})"
    offload = "-" if r.get("first_offload_s") is None else \
        f"{_f(r['first_offload_s'], '.2f', ' s')} / {_f(r.get('steady_offload_s'), '.2f', ' s')}"
    slept = {None: "-", 0: "no", 1: "yes"}.get(r.get("slept"), _f(r.get("slept"), ".1f"))
    cells = (r["date"], r["device"].upper(), r["cell"], r.get("rollout", "vllm"), str(finished), _f(r.get("step_s")),
             _f(r.get("rollout_s")), _f(r.get("train_s")), _f(r.get("switch_s"), ".3f", " s"), offload,
             _f(r.get("moved_gb"), ".1f"), slept, _f(r.get("peak_gb"), ".1f"), _f(r.get("micro_batches"), ".0f"),
             _f(r.get("tokens_per_s"), ",.0f"))
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict]) -> str:
    return "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD), *map(row, rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every run, not only the latest of each cell and device")
    p.add_argument("--missing", action="store_true", help="the matrix's cells no vLLM run has finished to step 20")
    p.add_argument("--root", default=str(ROOT), help="the results folder")
    args = p.parse_args(argv)
    rows = runs(Path(args.root))
    if args.missing:
        left = missing(rows)
        print(f"{len(MATRIX) - len(left)} of {len(MATRIX)} cells finished 20 steps with vLLM rollout; not yet:")
        print("\n".join(f"  {cell}: {why}" for cell, why in left))
        return 0
    print(table(rows if args.all else latest(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
