"""The step benchmark: an RL step's phases, medians over the steps of a job run as `gearshift train` runs it."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from .. import dist as gdist
from ..options import count, positive_int


#: the phases of an RL step, as the controller times them (time/<phase>); the rest of a step is the loop's own
STEP_PHASES = ("rollout", "reward", "old_logprobs", "ref_logprobs", "values", "train", "switch_to_rollout",
               "switch_to_train")


def measure_steps(config_path: str | None, overrides: list[str], steps: int = 5, skip: int = 1) -> dict[str, Any]:
    """Run `steps` RL steps of a job (a config file and overrides, as `gearshift train` takes them) and return
    each phase's median seconds over the steps after the first `skip`, the step's, and the loop's own: the
    time of a step that is in no phase."""
    from ..rl.config import load_config
    from ..rl.controller import Controller

    cfg = load_config(config_path, ["run.output_dir=runs/bench/step", *overrides, f"run.steps={steps}", "run.checkpoint_every=0", "run.resume=never",
                                    "run.progress=false", "run.samples_per_step=0", "run.plot=false",
                                    "run.tensorboard=false"])
    controller = Controller(cfg)
    try:
        rows = [controller.run_step() for _ in range(steps)]
    finally:
        controller.logger.close()
        # the engines go while the process group they share exists: left to the interpreter's exit, vLLM's
        # finalizer ran after it was gone and printed a traceback
        controller.close()
    kept = rows[skip:] or rows
    out: dict[str, Any] = {"steps": len(kept)}
    for name in ("step", *STEP_PHASES):
        vals = [r[f"time/{name}"] for r in kept if f"time/{name}" in r]
        if vals:
            out[name] = statistics.median(vals)
    loop = [r["time/step"] - sum(r.get(f"time/{n}", 0.0) for n in STEP_PHASES) for r in kept]
    out["loop"] = statistics.median(loop)
    out["tokens_per_s"] = statistics.median(r["rollout/tokens_per_s"] for r in kept)
    for key in ("train_tflops", "mfu"):  # the train phase's model FLOPs a second (gearshift.flops)
        vals = [r[f"perf/{key}"] for r in kept if f"perf/{key}" in r]
        if vals:
            out[key] = statistics.median(vals)
    return out


def bench_step(args: argparse.Namespace) -> int:
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:  # only overrides were given
        path, overrides = None, [path, *overrides]
    result = measure_steps(path, overrides, args.steps, args.skip)
    if gdist.rank() == 0:
        step = result["step"]
        rows = [(name, result[name]) for name in ("step", *STEP_PHASES, "loop") if name in result]
        print(f"step benchmark: medians of {result['steps']} steps after the first {args.skip}")
        for name, secs in rows:
            share = "" if name == "step" else f"  {100 * secs / step:5.1f}% of the step"
            print(f"  {name:<18}{secs:9.4f} s{share}")
        print(f"  {'rollout tokens/s':<18}{result['tokens_per_s']:9.0f}")
        if "train_tflops" in result:
            mfu = f"  MFU {100 * result['mfu']:.1f}% of the device's peak" if "mfu" in result else ""
            print(f"  {'train TFLOP/s':<18}{result['train_tflops']:9.4g}{mfu}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (optional; the default job without one)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for gearshift train")
    p.add_argument("--steps", type=positive_int, default=6, help="steps to run (default 6)")
    p.add_argument("--skip", type=count, default=1, help="first steps left out of the medians (default 1)")
    p.add_argument("--out", default="", help="write the medians to this JSON file")
