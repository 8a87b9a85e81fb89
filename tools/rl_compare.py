#!/usr/bin/env python3
"""RL runs side by side: one preset, several variants of the same job, their curves in one PNG.

    python tools/rl_compare.py rollout-correction   # bf16 hf rollout, fp32 training: none, tis, mis
    python tools/rl_compare.py ppo                  # PPO with its defaults beside GRPO, default job, 3 seeds
    python tools/rl_compare.py strict-reward        # the default job graded by numeric_match and strictly
    python tools/rl_compare.py ppo --steps 60 --jobs 1 -- rollout.backend=hf train.backend=torch

Each variant is one `gearshift train` process (overrides after `--` go to every variant). Runs land
in runs/compare/PRESET/VARIANT; the figure and a markdown table of the figures go to
docs/PRESET.png and docs/PRESET.md (`--out`). `--plot-only` redraws from runs already there.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRESETS: dict[str, dict] = {
    "rollout-correction": {
        "title": "bf16 rollout (hf), fp32 training (torch), GRPO",
        "base": ["rollout.backend=hf", "rollout.dtype=bfloat16", "train.backend=torch", "rollout.logprobs=always"],
        # mis at C=2 masks nothing on this model (ratios stay within about 0.97-1.03), so it would repeat
        # 'none' exactly; a cap of 1.01 shows masking at work
        "variants": {
            "none": ["algorithm.rollout_correction=none"],
            "tis_C2": ["algorithm.rollout_correction=tis", "algorithm.rollout_correction_cap=2.0"],
            "mis_C1.01": ["algorithm.rollout_correction=mis", "algorithm.rollout_correction_cap=1.01"],
        },
        "plots": [("reward/mean", "mean reward"), ("mismatch/logprob_mean", "|logp train - logp rollout|, mean"),
                  ("rollout_correction/ratio_max", "max ratio pi_train / pi_rollout"),
                  ("rollout_correction/masked_frac", "share of tokens masked (mis)")],
        "table": ["mismatch/logprob_mean", "mismatch/logprob_max", "rollout_correction/ratio_max",
                  "rollout_correction/truncated_frac", "rollout_correction/masked_frac"],
    },
    "ppo": {
        "title": "PPO with its defaults beside GRPO, three seeds each",
        "base": [],
        "variants": {f"{algo}_seed{seed}": [f"algorithm.name={algo}", f"run.seed={seed}"]
                     for algo in ("grpo", "ppo") for seed in (0, 1, 2)},
        "plots": [("reward/mean", "mean reward"), ("train/entropy", "policy entropy (nats/token)"),
                  ("train/critic/vf_loss", "critic loss")],
        "table": ["train/entropy", "train/critic/vf_loss"],
    },
    "strict-reward": {
        "title": "the default job, graded leniently and strictly",
        # every completion printed, so the table can grade the last steps' completions both ways
        "base": ["run.samples_per_step=256"],
        "variants": {"numeric_match": ["reward.fn=gearshift.rewards:numeric_match"],
                     "strict_numeric_match": ["reward.fn=gearshift.rewards:strict_numeric_match"]},
        "plots": [("reward/mean", "mean reward"), ("response_len/mean", "completion tokens, mean")],
        "table": ["response_len/mean"],
        "graded": True,
    },
}

QUIET = ["run.resume=never", "run.progress=false", "run.samples_per_step=0", "run.checkpoint_every=0",
         "run.tensorboard=false", "run.plot=false"]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_all(preset: dict, runs: Path, steps: int, jobs: int, extra: list[str],
            threads: int | None = None) -> dict[str, float]:
    """Start every variant (at most `jobs` at once); returns each one's wall time in seconds."""
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    pending = list(preset["variants"].items())
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    walls: dict[str, float] = {}
    while pending or running:
        while pending and len(running) < jobs:
            name, overrides = pending.pop(0)
            out = runs / name
            if out.exists():  # a run appends to metrics.jsonl: start from an empty folder
                shutil.rmtree(out)
            out.mkdir(parents=True)
            cmd = [sys.executable, "-m", "gearshift", "train", *QUIET, *preset["base"], *overrides, *extra,
                   f"run.steps={steps}", f"run.output_dir={out}"]
            print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
            log = (out / "train.log").open("w")
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time())
        time.sleep(2)
        for name, (proc, start) in list(running.items()):
            if proc.poll() is not None:
                walls[name] = time.time() - start
                del running[name]
                status = "done" if proc.returncode == 0 else f"FAILED ({proc.returncode}), see {runs / name}/train.log"
                print(f"== {name}: {status} in {walls[name] / 60:.1f} min", flush=True)
    return walls


SAMPLE = re.compile(r"^\[step (\d+)\] '(\d+)\+(\d+)=' -> (.*) \(reward ([-\d.e]+)\)$")


def graded(log: Path, last_step: int, steps: int = 10) -> str:
    """Of the printed completions of the last `steps` steps (the add task), the shares the lenient and the
    strict numeric match score 1."""
    from gearshift.rewards import numeric_match, strict_numeric_match

    lenient = strict = total = 0
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = SAMPLE.match(line)
        if not m or int(m.group(1)) <= last_step - steps:
            continue
        completion, answer = ast.literal_eval(m.group(4)), int(m.group(2)) + int(m.group(3))
        total += 1
        lenient += numeric_match(completion, answer) == 1.0
        strict += strict_numeric_match(completion, answer) == 1.0
    return f"{lenient / total:.3f} / {strict / total:.3f} ({total})" if total else "-"


def summarize(preset: dict, runs: Path, walls: dict[str, float]) -> list[str]:
    keys = preset["table"]
    extra = ["last 10 steps graded lenient / strict (completions)"] if preset.get("graded") else []
    lines = ["| variant | reward, first step | reward, last 10 steps | "
             + " | ".join([f"{k}, mean" for k in keys] + extra) + " | steps | minutes |",
             "|" + "---|" * (len(keys) + len(extra) + 5)]
    for name in preset["variants"]:
        rows = read(runs / name / "metrics.jsonl")
        if not rows:
            continue
        rewards = [r["reward/mean"] for r in rows]
        cells = [f"{statistics.fmean(r[k] for r in rows if k in r):.4g}" if any(k in r for r in rows) else "-"
                 for k in keys]
        if preset.get("graded"):
            cells.append(graded(runs / name / "train.log", rows[-1]["step"]))
        minutes = walls[name] / 60 if name in walls else sum(r.get("time/step", 0) for r in rows) / 60
        lines.append(f"| {name} | {rewards[0]:.3f} | {statistics.fmean(rewards[-10:]):.3f} | "
                     + " | ".join(cells) + f" | {len(rows)} | {minutes:.1f} |")
    return lines


def plot(preset: dict, runs: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = preset["plots"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    colors = {name: f"C{i}" for i, name in enumerate(preset["variants"])}  # one per variant in every panel
    for ax, (key, label) in zip(axes, panels):
        for name in preset["variants"]:
            rows = [r for r in read(runs / name / "metrics.jsonl") if key in r]
            if rows:
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=name, linewidth=1.2,
                        color=colors[name])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(preset["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--jobs", type=int, default=1, help="variants run at once (each gets cores / jobs threads)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per run (default: cores / jobs; 1 is faster on cores others use too)")
    p.add_argument("--variants", default="", help="comma-separated subset of the preset's variants")
    p.add_argument("--runs", default="runs/compare", help="folder of the runs (default runs/compare)")
    p.add_argument("--out", default="docs", help="folder for PRESET.png and PRESET.md (default docs)")
    p.add_argument("--plot-only", action="store_true", help="redraw from the runs already there")
    args = p.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    if args.variants:
        chosen = args.variants.split(",")
        unknown = set(chosen) - set(preset["variants"])
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; {args.preset} has {list(preset['variants'])}")
        preset["variants"] = {k: v for k, v in preset["variants"].items() if k in chosen}
    runs = Path(args.runs) / args.preset
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    walls = {} if args.plot_only else run_all(preset, runs, args.steps, args.jobs, extra, args.threads)
    lines = summarize(preset, runs, walls)
    command = f"python tools/rl_compare.py {args.preset}" + (" -- " + " ".join(extra) if extra else "")
    (out / f"{args.preset}.md").write_text(f"{preset['title']} (`{command}`)\n\n" + "\n".join(lines) + "\n")
    plot(preset, runs, out / f"{args.preset}.png")
    print("\n".join(lines))
    print(f"written: {out / args.preset}.png, {out / args.preset}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
