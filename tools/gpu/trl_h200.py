#!/usr/bin/env python3
"""TRL's GRPOTrainer beside gearshift on one GPU: the same job, one after the other, median step times side by side.

    python3 tools/gpu/trl_h200.py run --shape 0.5b --steps 10 --out DIR            # gearshift, then TRL
    python3 tools/gpu/trl_h200.py run --shape 7b --steps 6 --side trl --out DIR    # one side (a call's limit)
    python3 tools/gpu/trl_h200.py summary DIR [DIR ...] [--json FILE]              # both sides of each shape
    python3 tools/gpu/trl_h200.py check WHEELS_DIR [--extras vllm]                 # the carried wheels' needs met?

`run` writes the job as tools/trl_compare.py does on the CPU (the prompts in the order gearshift serves them, the
model folder, gearshift's own reward, the settings read off gearshift's config), then runs `gearshift train` on
it (vllm rollout, fsdp, the cell `<shape>-<tokens>-fsdp-auto` of tools/gpu/grpo_scenario.py: random Qwen2
weights, 32 prompts x 8 samples, bf16 rollout and compute) and TRL's GRPOTrainer through tools/trl_side.py
(vLLM colocated in the trainer's process, bf16), each as its own process. A step's time is the gap between two
step ends (gearshift's metrics lines as they arrive, TRL's `on_step_end`); the median is over the steps after
the first `--skip`. Each side writes `<side>.json` under DIR, and `summary.json` once both are there.

What is the same: the model folder, the prompts and their order, the reward (gearshift's `numeric_match`:
random weights earn 0, so both sides train on the entropy bonus, 0.01 by default, which TRL 1.16 has too),
32 prompts x 8 samples, 256 new tokens at temperature 1, plain sampling, AdamW at the same learning rate
(constant), no weight decay, gradient clipping at 1.0, no KL, clip 0.2, one update per batch, the token mean
over the batch (TRL's `dapo`), group-normalised advantages, no rollout correction (TRL's importance-sampling
correction off, so neither runs a pass for the old logprobs), no activation recomputation, vLLM with CUDA
graphs on both. What is not (UNEQUAL, also written into summary.json) is listed below.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tools" / "gpu")]

#: settings the two sides cannot share, as they stand
UNEQUAL = [
    "micro-batches: gearshift packs the 256 samples by length into micro-batches the device holds (its memory "
    "plan); TRL takes a fixed per_device_train_batch_size (--trl-micro-batch) with gradient accumulation up to "
    "one optimizer step of the whole batch",
    "memory between phases: gearshift's switch (switch.offload=auto) moves what its plan says and puts vLLM's "
    "KV cache to sleep; TRL keeps vLLM resident at vllm_gpu_memory_utilization (0.3, its default; gearshift's "
    "vLLM takes 0.5) unless --trl-sleep (vLLM sleep level 2: weights and KV cache freed, weights pushed again "
    "before each generation)",
    "weight sync: gearshift's resharder streams buckets into vLLM's load_weights; TRL calls load_weights once "
    "per parameter",
    "compute dtype: gearshift's FSDP casts the gathered weights to bf16 (param_dtype); TRL runs under bf16 "
    "autocast (matrix products in bf16, the rest in the weights' dtype)",
    "optimizer implementation: gearshift's AdamW on FSDP-sharded DTensors, TRL's the transformers default "
    "(adamw_torch_fused)",
    "vLLM engine arguments: TRL fixes max_num_batched_tokens=4096 and max_num_seqs to the generation batch; "
    "gearshift leaves vLLM's defaults",
    "advantage normalisation: TRL's group standard deviation has eps 1e-4, gearshift's 1e-6 (all-zero rewards "
    "give zero advantages on both)",
    "the samples themselves: each side draws from its own generator",
    "the rollout's logprobs: TRL asks vLLM for the sampled token's logprob at every step; gearshift "
    "(rollout.logprobs=auto, no rollout correction) on the first step and every tenth only, for its mismatch "
    "figures",
]

#: TRL's knobs by shape where a run on one H200 needs them (gearshift finds its own); `under_100gb`: what a card
#: of 80 GB needs instead (at 7B, 8 rows of 320 tokens a micro-batch beside 60 GB of bf16 weights, gradients
#: and Adam moments do not fit an H100; 4 ran, 2026-12-07)
TRL_SHAPE = {"0.5b": {"micro_batch": 32, "vllm_enable_sleep_mode": False},
             "1.5b": {"micro_batch": 16, "vllm_enable_sleep_mode": False},
             "7b": {"micro_batch": 8, "vllm_enable_sleep_mode": True, "under_100gb": {"micro_batch": 4}}}


def steady(ends: list[float], skip: int = 2) -> list[float]:
    """The step times after the first `skip` steps: gaps between step ends (the first step has no gap)."""
    return [ends[i] - ends[i - 1] for i in range(max(skip, 1), len(ends))]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def side_result(name: str, ends: list[float], rows: list[dict], skip: int, code: int | None, wall_s: float,
                steps: int, extra: dict | None = None) -> dict:
    """One side's figures: its median steady step time, how many steps finished and how it ended."""
    gaps = steady(ends, skip)
    return {"side": name, "steps_run": len(ends), "steps": steps, "step_s": median(gaps), "step_times": gaps,
            "exit": code, "timed_out": code is None, "wall_s": wall_s, **(extra or {})}


def merge(gearshift: dict | None, trl: dict | None, job: dict | None = None) -> dict:
    """Both sides of one shape into one record, with gearshift's step as a multiple of TRL's."""
    ratio = None
    if gearshift and trl and gearshift.get("step_s") and trl.get("step_s"):
        ratio = gearshift["step_s"] / trl["step_s"]
    return {"gearshift": gearshift, "trl": trl, "ratio": ratio, "job": job, "unequal": UNEQUAL}


def line(shape: str, record: dict) -> str:
    def fmt(side):
        r = record.get(side)
        if not r:
            return f"{side} not run"
        step = "-" if r.get("step_s") is None else f"{r['step_s']:.2f} s"
        how = "timed out" if r.get("timed_out") else f"exit {r.get('exit')}"
        return f"{side} {step}/step ({r['steps_run']} of {r['steps']} steps, {how})"

    ratio = record.get("ratio")
    return f"{shape}: {fmt('gearshift')}, {fmt('trl')}" + ("" if ratio is None else f": {ratio:.2f}x TRL's step")


# -- the carried wheels' requirements ------------------------------------------------------------------------------

def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """A wheel's name, version and Requires-Dist lines, read from its METADATA."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    head = text.split("\n\n", 1)[0].splitlines()
    field = lambda key: [h.split(":", 1)[1].strip() for h in head if h.startswith(key + ":")]  # noqa: E731
    return field("Name")[0], field("Version")[0], field("Requires-Dist")


def unmet(requires: list[str], versions: dict[str, str | None], extras: tuple[str, ...] = ()) -> list[str]:
    """The requirements (Requires-Dist lines) that `versions` (a normalised name -> installed version, None
    for absent) does not meet; a requirement under an extra counts only for the extras named."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = []
    for text in requires:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
            continue
        have = versions.get(canonicalize_name(req.name))
        if have is None:
            found.append(f"{req} (missing)")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            found.append(f"{req} (found {have})")
    return found


def installed_versions(carried: dict[str, str]) -> dict[str, str | None]:
    """What this interpreter can import, by normalised name, with the carried wheels over it."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    have: dict[str, str | None] = {}
    for dist in metadata.distributions():  # sys.path order: the first found of a name is the one imported
        have.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist.version)
    return {**have, **carried}


def check(args) -> int:
    from packaging.utils import canonicalize_name

    wheels = sorted(Path(args.wheels).glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.wheels}")
        return 2
    meta = [wheel_metadata(w) for w in wheels]
    carried = {canonicalize_name(n): v for n, v, _ in meta}
    have = installed_versions(carried)
    bad = 0
    for (name, version, requires) in meta:
        missing = unmet(requires, have, tuple(args.extras))
        bad += len(missing)
        print(f"{name} {version}: " + ("every requirement met" if not missing else "UNMET " + "; ".join(missing)))
    return 1 if bad else 0


# -- one run -------------------------------------------------------------------------------------------------------

def run_side(cmd: list[str], log: Path, steps_file: Path, read_end, timeout: float | None) -> tuple[int | None, list[float], float]:
    """Start `cmd`, record each step's end as `read_end` sees it in `steps_file`, stop it at `timeout`."""
    from trl_compare import watch

    t0 = time.time()
    ends: list[float] = []
    seen: list[float] = []
    read = 0
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        code = None
        while True:
            code = proc.poll()
            if read_end == "arrival":
                read = watch(steps_file, seen, read)
            if code is not None:
                break
            if timeout and time.time() - t0 > timeout:
                proc.kill()
                proc.wait()
                code = None
                break
            time.sleep(0.02)
        if read_end == "arrival":
            watch(steps_file, seen, read)
            ends = seen
    return code, ends, time.time() - t0


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def trl_section(args, s: dict, gpu: bool, device_gib: float | None = None) -> dict:
    """TRL's own knobs for the job (tools/trl_side.py reads them): vLLM colocated on a GPU, bf16 there, the
    micro-batch and the memory settings of the shape unless given, and no importance-sampling correction unless
    asked (`--trl-gradient-checkpointing --trl-importance-sampling` is TRL's GRPOConfig as it comes)."""
    shape = TRL_SHAPE[args.shape]
    if gpu and device_gib is not None and device_gib < 100:
        shape = {**shape, **shape.get("under_100gb", {})}
    return {"use_vllm": {"on": True, "off": False, "auto": gpu}[args.trl_vllm], "bf16": gpu,
            "model_dtype": s["model_dtype"],
            "micro_batch": min(args.trl_micro_batch or shape["micro_batch"], s["prompts"] * s["n"]),
            "gradient_checkpointing": args.trl_gradient_checkpointing,
            "vllm_enable_sleep_mode": shape["vllm_enable_sleep_mode"] if args.trl_sleep is None else args.trl_sleep,
            "vllm_gpu_memory_utilization": args.trl_gpu_memory,
            "vllm_max_model_length": s["max_prompt_len"] + s["max_tokens"],
            "importance_sampling": args.trl_importance_sampling}


def run(args) -> int:
    import grpo_scenario
    from trl_compare import write_job

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cell = grpo_scenario.parse_cell(f"{args.shape}-{args.tokens}-fsdp-auto")
    cell["rollout"] = "vllm"
    overrides = [*grpo_scenario.overrides(cell, args.steps, out / "gearshift", args.prompts, args.n, args.model),
                 f"algorithm.entropy_coef={args.entropy_coef}", *args.set]
    job, gs_overrides = write_job(out, args.seed, args.steps, "default", overrides)
    import torch

    gpu = torch.cuda.is_available()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else None
    job.update(device="cuda" if gpu else "cpu", threads=0 if gpu else 1,
               trl=trl_section(args, job["settings"], gpu, gib))
    job_file = out / f"job-{args.seed}.json"
    job_file.write_text(json.dumps(job, indent=1))
    budget = args.budget_s
    per_side = (budget / 2 if args.side == "both" else budget) if budget else None
    if args.side in ("both", "gearshift"):
        gs_dir = out / "gearshift"
        cmd = [sys.executable, "-m", "gearshift", "train", *gs_overrides]
        code, ends, wall = run_side(cmd, out / "gearshift.log", gs_dir / "metrics.jsonl", "arrival", per_side)
        rows = jsonl(gs_dir / "metrics.jsonl")
        phases = grpo_scenario.summarize(cell, rows, code or 0, wall, "")
        keep = ("step_s", "rollout_s", "old_logprobs_s", "train_s", "switch_s", "kv_wake_s", "peak_gb",
                "micro_batches", "tokens_per_s", "train_tflops", "mfu")
        result = side_result("gearshift", ends, rows, args.skip, code, wall, args.steps, {
            "metrics": {k: phases[k] for k in keep}, "overrides": args.set, "per_step": rows,
            "log_tail": (out / "gearshift.log").read_text()[-3000:] if code else ""})
        (out / "gearshift.json").write_text(json.dumps(result, indent=1))
        print(line(args.shape, merge(result, None)), flush=True)
        if budget:
            per_side = max(budget - wall, 60) if args.side == "both" else per_side
    if args.side in ("both", "trl"):
        steps_file = Path(job["trl_steps"])
        cmd = [args.trl_python, str(ROOT / "tools" / "trl_side.py"), str(job_file)]
        code, _, wall = run_side(cmd, out / "trl.log", steps_file, None, per_side)
        rows = jsonl(steps_file)
        result = side_result("trl", [r["end"] for r in rows], rows, args.skip, code, wall, args.steps, {
            "per_step": rows, "log_tail": (out / "trl.log").read_text()[-3000:] if code else ""})
        (out / "trl.json").write_text(json.dumps(result, indent=1))
    record = summarize_dir(out)
    print(line(args.shape, record), flush=True)
    return 0


def summarize_dir(folder: Path) -> dict:
    """Merge whatever sides ran in `folder` into summary.json there."""
    load = lambda name: json.loads((folder / name).read_text()) if (folder / name).exists() else None  # noqa: E731
    jobs = sorted(folder.glob("job-*.json"))
    record = merge(load("gearshift.json"), load("trl.json"), json.loads(jobs[0].read_text()) if jobs else None)
    (folder / "summary.json").write_text(json.dumps(record, indent=1))
    return record


def summary(args) -> int:
    records = {}
    for folder in map(Path, args.dirs):
        record = summarize_dir(folder)
        records[folder.name] = record
        print(line(folder.name, record))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog="Settings that cannot be made equal:\n" + "\n".join(f"- {u}" for u in UNEQUAL))
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="one shape: gearshift's side, TRL's side or both")
    r.add_argument("--shape", choices=sorted(TRL_SHAPE), default="0.5b", help="the Qwen2 shape (random weights)")
    r.add_argument("--model", help="another model for both sides (a dry run on a CPU: --model tiny)")
    r.add_argument("--tokens", type=int, default=256, help="answer tokens (default 256)")
    r.add_argument("--prompts", type=int, default=32)
    r.add_argument("--n", type=int, default=8, help="samples per prompt")
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--skip", type=int, default=2, help="first steps left out of the median (default 2)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--side", choices=("both", "gearshift", "trl"), default="both")
    r.add_argument("--entropy-coef", type=float, default=0.01, help="both sides' entropy bonus (default 0.01)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more gearshift config override; what the job reads from it goes to TRL too")
    r.add_argument("--trl-python", default=sys.executable, help="the python TRL runs in (default this one)")
    r.add_argument("--trl-vllm", choices=("auto", "on", "off"), default="auto",
                   help="TRL generates with colocated vLLM (auto: on a GPU) or its own generate()")
    r.add_argument("--trl-micro-batch", type=int, help="TRL's per_device_train_batch_size (default by shape: "
                   + ", ".join(f"{k} {v['micro_batch']}" + (f" ({v['under_100gb']['micro_batch']} on a card under "
                                                             "100 GB)" if "under_100gb" in v else "")
                               for k, v in TRL_SHAPE.items()) + ")")
    r.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL recomputes activations (GRPOConfig's default)")
    r.add_argument("--trl-importance-sampling", action="store_true",
                   help="TRL corrects for vLLM's sampling with importance weights, which takes a forward pass of "
                        "its own for the old logprobs (GRPOConfig's default with vLLM)")
    r.add_argument("--trl-sleep", type=lambda v: v.lower() in ("1", "true", "on", "yes"), default=None,
                   help="TRL's vllm_enable_sleep_mode (default by shape: on at 7b)")
    r.add_argument("--trl-gpu-memory", type=float, default=0.3, help="TRL's vllm_gpu_memory_utilization (0.3)")
    r.add_argument("--budget-s", type=float, default=0,
                   help="stop a side after this many seconds (both: half each, what gearshift leaves to TRL)")
    r.add_argument("--out", default="runs/trl_h200")
    s = sub.add_parser("summary", help="merge the sides that ran, one folder a shape")
    s.add_argument("dirs", nargs="+")
    s.add_argument("--json", help="all shapes into this file")
    c = sub.add_parser("check", help="are the carried wheels' requirements met here?")
    c.add_argument("wheels")
    c.add_argument("--extras", nargs="*", default=["vllm"], help="extras whose requirements count (vllm)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return {"run": run, "summary": summary, "check": check}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
