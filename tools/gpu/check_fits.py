#!/usr/bin/env python3
"""Whether a policy can train on this device at all: the RL loop's check right after it builds the policy.

    python3 tools/gpu/check_fits.py --model qwen2-7b --dtype bfloat16 --longest 320 \
        --trainers 'deepspeed:{"zero_stage": 3}' 'fsdp:{}'

For each trainer, one after the other in this process: builds the policy as `gearshift train` does (the given
dtype, no memory options), prints the device memory it holds, what its step would allocate (`step_bytes`) and
the verdict of `memory.check_train_fits` over rows of `--longest` tokens: "fits", or the `MemoryPlanError` a run
would stop with. A tool, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from gearshift import registry
from gearshift.memory import GiB, MemoryPlanError, check_train_fits
from gearshift.models import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--longest", type=int, default=320, help="the longest row a step meets (prompt + answer)")
    p.add_argument("--trainers", nargs="+", default=['deepspeed:{"zero_stage": 3}', "fsdp:{}"],
                   help="NAME:JSON options, one trainer each")
    args = p.parse_args()
    path = resolve_model(args.model)
    for spec in args.trainers:
        name, _, options = spec.partition(":")
        engine = registry.create("train", name, model=path, dtype=args.dtype, lr=1e-6, **json.loads(options or "{}"))
        held = torch.cuda.memory_allocated(engine.device) if engine.device.type == "cuda" else 0
        grads, update = engine.step_bytes()
        try:
            check_train_fits(engine, args.longest)
            verdict = "fits"
        except MemoryPlanError as err:
            verdict = f"MemoryPlanError: {err}"
        print(f"[{args.model} {name} {options or '{}'}] held {held / GiB:.1f} GiB, step's gradients "
              f"{grads / GiB:.1f} GiB, update {update / GiB:.1f} GiB: {verdict}", flush=True)
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
