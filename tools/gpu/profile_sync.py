#!/usr/bin/env python3
"""Where a switch's time goes: torch.profiler over one switch to rollout, after warm-up switches.

    torchrun --nproc_per_node 2 tools/gpu/profile_sync.py --model qwen2-0.5b --train fsdp --rollout hf \
        --rollout-options '{"dtype": "bfloat16"}'
    python3 tools/gpu/profile_sync.py --train deepspeed --train-options '{"zero_stage": 3}' --rollout sglang \
        --rollout-options '{"dtype": "bfloat16"}' --offload optimizer,grads     # the offload beside SGLang

Prints rank 0's switch report, the allocator's settings, and the operators sorted by host time and by device
time; on a GPU also the process's CPU affinity and a plain device-to-pinned-host copy's rate, before the rollout
engine is built and after (does the engine's start change how fast this process copies to host memory?). A tool,
not a test.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from gearshift import dist as gdist, registry
from gearshift.hybrid import HybridActor
from gearshift.models import resolve_model


def host_copy(label: str, mb: int = 512) -> None:
    """This process's CPU affinity and the rate of one device -> pinned host copy of `mb` MiB (best of 3)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    line = f"[{label}] CPU affinity: {len(cpus)} CPUs ({cpus[0] if cpus else '-'}..{cpus[-1] if cpus else '-'})"
    if torch.cuda.is_available():
        src = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        dst = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        line += f"; device -> pinned host {mb} MiB at {(mb << 20) / best / 1e9:.1f} GB/s"
        del src, dst
    print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--train", default="fsdp")
    p.add_argument("--rollout", default="hf")
    p.add_argument("--rollout-options", default="{}")
    p.add_argument("--train-options", default="{}")
    p.add_argument("--offload", default="", help="train tags moved to host memory at every switch (none: '')")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    gdist.init()
    path = resolve_model(args.model)
    train = registry.create("train", args.train, model=path, **json.loads(args.train_options))
    host_copy("before the rollout engine")
    rollout = registry.create("rollout", args.rollout, model=path, **json.loads(args.rollout_options))
    host_copy("after the rollout engine")
    actor = HybridActor(train, rollout, offload=[t for t in args.offload.split(",") if t])
    for _ in range(3):
        actor.to_rollout()
        actor.to_train()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        report = actor.to_rollout()
        gdist.synchronize()
    actor.to_train()
    if gdist.rank() == 0:
        print(report.table())
        print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}")
        if torch.cuda.is_available():
            print(f"allocator backend: {torch.cuda.memory.get_allocator_backend()}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if torch.cuda.is_available():
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
