#!/usr/bin/env python3
"""gearshift's default GRPO job beside TRL's GRPOTrainer on the same job: same weights, prompts, reward, batch.

    python tools/trl_compare.py                    # gearshift's default engines (vllm + fsdp)
    python tools/trl_compare.py --engines hf       # rollout.backend=hf train.backend=torch: TRL's own engines
    python tools/trl_compare.py --seeds 0,1,2 --steps 120 --trl-python .venv-trl/bin/python

TRL runs in its own environment (`bash tools/trl_env.sh` makes `.venv-trl`: torch 2.13 CPU, transformers
5.19, trl 1.16). Both runs start at the same time, one core each (taskset) and one thread each, so each
sees the same machine. Printed: the median step time of each over the steps both were running, the ratio,
and the mean reward of the last ten steps; `--out` (default runs/trl_compare) keeps the job, both step logs
and a JSON summary.

What is the same: the model folder (the default job's `small-add`), the prompts in the order gearshift
serves them (TRL reads them unshuffled), gearshift's own `numeric_match` reward, 32 prompts x 8 samples,
4 new tokens at temperature 1, AdamW at the same learning rate (constant), no weight decay, gradient
clipping at 1.0, no KL term, clip 0.2, one update per batch, the loss a token mean over the batch (TRL's
`dapo`), advantages normalised by each group's standard deviation, no activation recomputation (TRL's
GRPOConfig turns gradient checkpointing on unless told otherwise; the job turns it off). What is not: TRL's
standard deviation has eps 1e-4 where gearshift's has 1e-6, and the samples differ (each draws from its own
generator).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"default": [], "hf": ["rollout.backend=hf", "train.backend=torch"]}


def write_job(out: Path, seed: int, steps: int, engines: str, extra: list[str]) -> tuple[dict, list[str]]:
    """The prompts gearshift will serve, in order, and the settings TRL must take from gearshift's config."""
    from gearshift.models import resolve_model
    from gearshift.rl.config import load_config
    from gearshift.rl.data import PromptDataset

    overrides = [*ENGINES[engines], f"run.seed={seed}", f"run.steps={steps}", *extra]
    cfg = load_config(None, overrides)
    if cfg.algorithm.name != "grpo" or cfg.algorithm.kl_coef or cfg.algorithm.epochs != 1:
        raise SystemExit("trl_compare: the comparison is of one GRPO update per batch without a KL term")
    data = PromptDataset.from_config(cfg.data)
    prompts = out / f"prompts-{seed}.jsonl"
    with prompts.open("w") as f:
        for _ in range(steps):
            for row in data.next_batch(cfg.run.prompts_per_step):
                f.write(json.dumps({"prompt": row[cfg.data.prompt_key], "answer": row["answer"]}) + "\n")
    rule = cfg.reward.rule(cfg.data) or ""
    module, _, name = rule.partition(":")
    if module != "gearshift.rl.rewards":
        raise SystemExit(f"trl_compare: the reward {rule!r} is not one of gearshift's built-in rewards")
    job = {
        "model": resolve_model(cfg.model.path), "prompts": str(prompts), "seed": seed, "steps": steps, "threads": 1,
        "reward_file": str(ROOT / "packages/core/src/gearshift/rl/rewards.py"), "reward_name": name,
        "trl_dir": str(out / f"trl-{seed}"), "trl_steps": str(out / f"trl-{seed}.jsonl"),
        "settings": {"prompts": cfg.run.prompts_per_step, "n": cfg.rollout.n, "max_tokens": cfg.rollout.max_tokens,
                     "temperature": cfg.rollout.temperature, "lr": cfg.policy_lr(), "clip": cfg.algorithm.clip_low,
                     "weight_decay": cfg.train.weight_decay, "max_grad_norm": cfg.train.max_grad_norm,
                     "entropy_coef": cfg.algorithm.entropy_coef, "max_prompt_len": cfg.data.max_prompt_len,
                     "model_dtype": cfg.model.dtype, "rollout_dtype": cfg.rollout.dtype or cfg.model.dtype},
        # TRL's GRPOConfig recomputes activations by default; gearshift's trainers do not
        "gradient_checkpointing": False,
    }
    if cfg.algorithm.clip_high != cfg.algorithm.clip_low or cfg.rollout.top_p != 1 or cfg.rollout.top_k:
        raise SystemExit("trl_compare: use one clip range and plain sampling (top_p 1, top_k 0) on both sides")
    if cfg.algorithm.rollout_correction != "none":
        raise SystemExit("trl_compare: the comparison is without a rollout correction (TRL's IS correction off)")
    (out / f"job-{seed}.json").write_text(json.dumps(job, indent=1))
    return job, overrides


def watch(path: Path, seen: list[float], size: int) -> int:
    """Record the arrival time of each new line of a jsonl file; returns the bytes read so far. Reads only
    what was appended (the poller shares the cores with the two runs it times)."""
    try:
        grown = path.stat().st_size > size
    except FileNotFoundError:
        return size
    if not grown:
        return size
    with path.open("rb") as f:
        f.seek(size)
        new = f.read()
    whole = new[:new.rfind(b"\n") + 1]  # a line still being written waits for the next poll
    seen.extend(time.time() for _ in range(whole.count(b"\n")))
    return size + len(whole)


def cores_used(pid: int, seen: set[int]) -> None:
    """Add the cores each thread of `pid` (and of its children) is allowed on: an engine that binds its own
    threads elsewhere would break the one-core-each rule, and shows here."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            status = (task / "status").read_text()
            children = (task / "children").read_text().split()
        except OSError:
            continue
        allowed = next(line.split(":")[1].strip() for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
        for part in allowed.split(","):
            lo, _, hi = part.partition("-")
            seen.update(range(int(lo), int(hi or lo) + 1))
        for child in children:
            cores_used(int(child), seen)


def shared_median(ends: list[float], window: tuple[float, float]) -> tuple[float, int]:
    """Median of the step times (gaps between step ends) whose both ends fall inside `window`."""
    gaps = [b - a for a, b in zip(ends, ends[1:]) if a >= window[0] and b <= window[1]]
    return (statistics.median(gaps) if gaps else float("nan")), len(gaps)


def run_pair(out: Path, seed: int, steps: int, engines: str, trl_python: str, extra: list[str]) -> dict:
    job, overrides = write_job(out, seed, steps, engines, extra)
    gs_dir = out / f"gearshift-{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    gs_cmd = ["taskset", "-c", "0", sys.executable, "-m", "gearshift", "train", *overrides,
              f"run.output_dir={gs_dir}", "run.resume=never", "run.plot=false", "run.progress=false",
              "run.tensorboard=false", "run.checkpoint_every=0"]
    trl_cmd = ["taskset", "-c", "1" if os.cpu_count() > 1 else "0", trl_python, str(ROOT / "tools/trl_side.py"),
               str(out / f"job-{seed}.json")]
    logs = {name: open(out / f"{name}-{seed}.log", "w") for name in ("gearshift", "trl")}
    procs = {"gearshift": subprocess.Popen(gs_cmd, env=env, stdout=logs["gearshift"], stderr=subprocess.STDOUT),
             "trl": subprocess.Popen(trl_cmd, env=env, stdout=logs["trl"], stderr=subprocess.STDOUT)}
    gs_ends: list[float] = []
    read, polls = 0, 0
    cores: dict[str, set[int]] = {name: set() for name in procs}
    while any(p.poll() is None for p in procs.values()):
        read = watch(gs_dir / "metrics.jsonl", gs_ends, read)
        if polls % 250 == 249:  # every 5 s, from 5 s on (taskset has set the affinity by then)
            for name, p in procs.items():
                cores_used(p.pid, cores[name])
        polls += 1
        time.sleep(0.02)
    watch(gs_dir / "metrics.jsonl", gs_ends, read)
    for name, p in procs.items():
        if p.returncode:
            tail = (out / f"{name}-{seed}.log").read_text()[-3000:]
            raise SystemExit(f"trl_compare: the {name} run failed (exit {p.returncode}):\n{tail}")
    gs_rows = [json.loads(line) for line in (gs_dir / "metrics.jsonl").read_text().splitlines()]
    trl_rows = [json.loads(line) for line in Path(job["trl_steps"]).read_text().splitlines()]
    trl_ends = [r["end"] for r in trl_rows]
    window = (max(gs_ends[0], trl_ends[0]), min(gs_ends[-1], trl_ends[-1]))
    gs_step, gs_n = shared_median(gs_ends, window)
    trl_step, trl_n = shared_median(trl_ends, window)
    last = min(10, len(gs_rows), len(trl_rows))
    return {"seed": seed, "engines": engines, "steps": steps,
            "gearshift_step_s": gs_step, "trl_step_s": trl_step, "ratio": gs_step / trl_step,
            "shared_steps": [gs_n, trl_n], "cores": {k: sorted(v) for k, v in cores.items()},
            "gearshift_last10": statistics.mean(r["reward/mean"] for r in gs_rows[-last:]),
            "trl_last10": statistics.mean(r["reward"] for r in trl_rows[-last:]),
            "gearshift_phases": {k: statistics.median(r[k] for r in gs_rows[1:] if k in r)
                                 for k in ("time/rollout", "time/reward", "time/train", "time/old_logprobs")
                                 if any(k in r for r in gs_rows[1:])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", choices=sorted(ENGINES), default="default",
                   help="gearshift's engines: default (its job's vllm + fsdp) or hf (hf rollout + torch train)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, one pair of runs each (default 0)")
    p.add_argument("--steps", type=int, default=120, help="steps of each run (default 120, the default job's)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"),
                   help="the python of TRL's own environment (default .venv-trl/bin/python; tools/trl_env.sh)")
    p.add_argument("--out", default="runs/trl_compare", help="where the job, logs and summary go")
    p.add_argument("overrides", nargs="*", help="more gearshift config overrides, applied to both sides")
    args = p.parse_args()
    if not Path(args.trl_python).exists():
        print(f"trl_compare: {args.trl_python} does not exist; make TRL's environment with: bash tools/trl_env.sh",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        r = run_pair(out, seed, args.steps, args.engines, args.trl_python, args.overrides)
        results.append(r)
        print(f"seed {seed} ({args.engines} engines): gearshift {r['gearshift_step_s']:.3f} s/step, "
              f"TRL {r['trl_step_s']:.3f} s/step over the steps both ran ({r['shared_steps'][0]} and "
              f"{r['shared_steps'][1]}): {r['ratio']:.2f}x; last-ten reward gearshift {r['gearshift_last10']:.3f}, "
              f"TRL {r['trl_last10']:.3f}; cores gearshift {r['cores']['gearshift']}, TRL {r['cores']['trl']}",
              flush=True)
        print("  gearshift phases (median s): " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in
                                                           r["gearshift_phases"].items()), flush=True)
    (out / f"summary-{args.engines}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
