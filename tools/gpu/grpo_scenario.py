#!/usr/bin/env python3
"""GRPO at realistic shapes, cell by cell, each run as a user would start it (`python -m gearshift train`).

    python3 tools/gpu/grpo_scenario.py --cells 7b-256-fsdp-auto,0.5b-1024-fsdp-forced --steps 20 --out $OUT

A cell is `<model>-<answer tokens>-<trainer>-<offload>[-shared]`: model 0.5b, 1.5b or 7b (the Qwen2 shapes,
random weights), answer length in tokens, trainer fsdp or deepspeed, offload `auto` (the memory plan) or
`forced` (optimizer and grads to host memory and the rollout engine put to sleep at every switch); `-shared`
adds `train.share_prompts=true` (a prompt computed once for its samples; off on a GPU by default). Every cell runs
32 prompts x 8 samples per step with vLLM rollout (`--rollout sglang` for SGLang's, `--rollout hf` for
transformers' own generate, which needs no carry) and no memory options: the
default micro-batching has to fit by itself. Master weights are bf16 at 7B (fp32 does not fit beside the
rollout engine) and fp32 below.

Each cell is its own process (one rollout engine per process). The table printed last has, per cell, the steps
that finished, the median step time after the first two and its split (rollout, old logprobs, train, both
switches), the first and the steady offload, the peak memory, the KV-cache wake, what the plan moved and
the generated tokens/s; `scenario.json` under --out keeps every step's metrics. `--budget-s` stops a cell at the budget (it keeps
the steps it finished) and starts no later cell that would not finish in the time left (the cells not run
are listed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"0.5b": "qwen2-0.5b", "1.5b": "qwen2-1.5b", "7b": "qwen2-7b"}
#: seconds a step is expected to need per answer token, by model (for --budget-s), and a cell's start (engines
#: up, CUDA graphs captured): seen on one H200 with 32 x 8 samples a step, vLLM's CUDA graphs and no memory
#: options, the 0.5B step 15.8 s at 1,024 tokens, the 1.5B 5.5 s at 256 and the 7B 10.3 s at 256 and 47.4 s
#: at 1,024 (tokens/s falls with the answer length: the training attention and the KV cache grow with it); on
#: an H100 (2026-12-07) the 1.5B 16.5 s at 1,024 with forced offload, the 7B 9.8 s at 256
STEP_TOKEN_S = {"0.5b": 0.016, "1.5b": 0.018, "7b": 0.047}
#: a cell's start by rollout engine: vLLM's on the H200; SGLang 0.5.17's first start on a fresh machine (an H100,
#: 0.5B, ZeRO-3) spent 79 s compiling and capturing its piecewise prefill graphs (58 sizes) and then its decode
#: graphs, and had not run a step 150 s in
START_S = {"vllm": 90, "sglang": 210, "hf": 60}
#: deepspeed's step against fsdp's, by model: ZeRO-3's per-module work in every micro-batch (7B x 256 on the
#: H200 20.2 s against 10.3 s; 1.5B x 1024 forced on an H100 29.2 s against 16.5 s; at 0.5B about the same)
DEEPSPEED_FACTOR = {"0.5b": 1.0, "1.5b": 1.8, "7b": 2.0}


def expected_s(cell: dict, steps: int, rollout: str = "vllm") -> float:
    """The seconds a cell is expected to take, start included."""
    factor = DEEPSPEED_FACTOR[cell["model"]] if cell["trainer"] == "deepspeed" else 1.0
    return START_S[rollout] + steps * STEP_TOKEN_S[cell["model"]] * cell["tokens"] * factor


def parse_cell(cell: str) -> dict:
    parts = cell.split("-")
    shared = parts[-1] == "shared"  # `train.share_prompts=true`: off on a GPU unless asked
    if shared:
        parts = parts[:-1]
    if len(parts) != 4:
        raise SystemExit(f"bad cell {cell!r}: <{'|'.join(MODELS)}>-<tokens>-<fsdp|deepspeed>-<auto|forced>[-shared]")
    model, tokens, trainer, offload = parts
    if model not in MODELS or trainer not in ("fsdp", "deepspeed") or offload not in ("auto", "forced"):
        raise SystemExit(f"bad cell {cell!r}: <{'|'.join(MODELS)}>-<tokens>-<fsdp|deepspeed>-<auto|forced>[-shared]")
    return {"cell": cell, "model": model, "tokens": int(tokens), "trainer": trainer, "offload": offload,
            "shared": shared}


ROLLOUTS = ("vllm", "sglang", "hf")


def overrides(c: dict, steps: int, out: Path, prompts: int, n: int, model: str | None = None) -> list[str]:
    args = [f"model.path={model or MODELS[c['model']]}", f"train.backend={c['trainer']}",
            f"rollout.backend={c.get('rollout', 'vllm')}",
            f"run.steps={steps}", f"run.prompts_per_step={prompts}", f"rollout.n={n}",
            f"rollout.max_tokens={c['tokens']}", "rollout.dtype=bfloat16",
            # a random model's answers earn nothing: the entropy bonus gives every update a gradient all the same
            "algorithm.entropy_coef=0.01", "run.checkpoint_every=0", "run.progress=false",
            "run.samples_per_step=0", "run.tensorboard=false", "run.plot=false", "run.resume=never",
            f"run.output_dir={out}", "data.max_prompt_len=64"]
    if c["model"] == "7b":
        args.append("model.dtype=bfloat16")
    if c["offload"] == "forced":
        args.append("switch.offload=optimizer,grads")
    if c["trainer"] == "deepspeed":
        args.append('train.options={"zero_stage": 3}')
    if c.get("shared"):
        args.append("train.share_prompts=true")
    return args


def summarize(c: dict, rows: list[dict], code: int, seconds: float, tail: str) -> dict:
    steady = rows[2:] or rows

    def med(key):
        vals = [r[key] for r in steady if key in r]
        return statistics.median(vals) if vals else None

    # the first offload that moved anything: step 1's trainer has no optimizer state yet, so it moves nothing
    offloads = [r["switch/offload"] for r in rows if r.get("switch/offload") and r.get("switch/offload_gb", 1) > 0]
    return {**c, "exit": code, "wall_s": seconds, "steps": len(rows), "step_s": med("time/step"),
            "rollout_s": med("time/rollout"), "old_logprobs_s": med("time/old_logprobs"),
            "train_s": med("time/train"),
            "switch_s": (med("time/switch_to_rollout") or 0) + (med("time/switch_to_train") or 0),
            "first_offload_s": offloads[0] if offloads else None,
            "steady_offload_s": statistics.median(offloads[1:]) if len(offloads) > 1 else None,
            "kv_wake_s": med("switch/wake_kv_cache"), "peak_gb": max((r.get("memory/peak_gb", 0) for r in rows),
                                                                      default=None),
            "moved_gb": med("switch/offload_gb"), "slept": med("switch/rollout_slept"),
            "micro_batches": med("train/micro_batches"), "tokens_per_s": med("rollout/tokens_per_s"),
            "train_tflops": med("perf/train_tflops"), "mfu": med("perf/mfu"),
            "error": None if code == 0 else (f"stopped at the time budget after {len(rows)} steps" if code == STOPPED
                                             else tail[-2000:])}


#: the exit code of a cell stopped at the time budget (as `timeout` reports it)
STOPPED = 124


#: set once SIGTERM ended a cell: no further cell starts
terminated = False


class Terminated(Exception):
    """This script was asked to end (SIGTERM: a `timeout` around it, a job stopped)."""


def _terminate(signum, frame):
    raise Terminated


def run_cell(cmd: list[str], timeout: float | None) -> tuple[int, str]:
    """Run one cell's `gearshift train` in its own process group; past `timeout` seconds, or when this script
    is terminated (`Terminated`, raised by its SIGTERM handler), the group is killed and the code is `STOPPED`:
    a cell's run never outlives the script to hold the GPU. Returns the exit code and the output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except (subprocess.TimeoutExpired, Terminated) as stop:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if isinstance(stop, Terminated):
            global terminated
            terminated = True
        return STOPPED, output


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="0.5b-256-fsdp-auto")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=0, help="start no cell that would not end in this time")
    p.add_argument("--out", default="runs/scenario")
    p.add_argument("--rollout", default="vllm", choices=ROLLOUTS, help="the rollout backend of every cell")
    p.add_argument("--model", help="run every cell on this model instead (a dry run on a CPU: --model small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more run-config override for every cell (repeatable), e.g. rollout.options=...")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, results, skipped = time.time(), [], []
    signal.signal(signal.SIGTERM, _terminate)
    for cell in [parse_cell(c) for c in args.cells.split(",") if c]:
        if terminated:
            skipped.append(cell["cell"])
            continue
        need = expected_s(cell, args.steps, args.rollout)
        left = args.budget_s - (time.time() - start) if args.budget_s else None
        if left is not None and not results and need > left:
            print(f"[{cell['cell']}] expected to need about {need:.0f} s for {args.steps} steps: the budget's "
                  f"{left:.0f} s stops it first (raise --budget-s to finish it)", flush=True)
        # the first cell always starts (stopped at the budget, it keeps the steps it finished); a later one
        # only when it is expected to finish
        if left is not None and results and need > left:
            skipped.append(cell["cell"])
            continue
        cell["rollout"] = args.rollout
        run_dir = out / cell["cell"]
        t0 = time.time()
        code, output = run_cell([sys.executable, "-m", "gearshift", "train",
                                 *overrides(cell, args.steps, run_dir, args.prompts, args.n, args.model), *args.set],
                                timeout=left)
        (out / f"{cell['cell']}.log").write_text(output)
        path = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        result = summarize(cell, rows, code, time.time() - t0, output)
        if terminated:
            result["error"] = f"terminated after {len(rows)} steps"
        result["per_step"] = rows
        results.append(result)
        why = " (terminated)" if terminated else " (stopped at the time budget)"
        print(f"[{cell['cell']}] exit {code}, {len(rows)} steps in {time.time() - t0:.0f} s"
              + (why if code == STOPPED else ""), flush=True)
        if code and code != STOPPED:
            print(result["error"][-1200:], flush=True)
    (out / "scenario.json").write_text(json.dumps({"cells": results, "not_run": skipped}, indent=1))
    print(f"rollout: {args.rollout}")
    head = ("cell", "exit", "steps", "step s", "rollout", "old lp", "train", "switches", "1st offload", "offload",
            "kv wake", "peak GB", "moved GB", "slept", "mbs", "tok/s", "train TFLOP/s", "MFU")
    print(" | ".join(head))
    for r in results:
        print(" | ".join([r["cell"], str(r["exit"]), str(r["steps"]), fmt(r["step_s"]), fmt(r["rollout_s"]),
                          fmt(r["old_logprobs_s"]), fmt(r["train_s"]), fmt(r["switch_s"], ".3f"),
                          fmt(r["first_offload_s"], ".3f"), fmt(r["steady_offload_s"], ".3f"),
                          fmt(r["kv_wake_s"], ".3f"), fmt(r["peak_gb"], ".1f"), fmt(r["moved_gb"], ".1f"),
                          fmt(r["slept"], ".0f"), fmt(r["micro_batches"], ".0f"), fmt(r["tokens_per_s"], ".0f"),
                          fmt(r.get("train_tflops"), ".0f"), fmt(r.get("mfu"), ".1%")]))
    if skipped:
        print(f"not run ({'terminated' if terminated else 'time budget'}): {','.join(skipped)}")
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
