#!/usr/bin/env python3
"""Where a switch's time goes: torch.profiler over one switch to rollout, after warm-up switches.

    torchrun --nproc_per_node 2 tools/gpu/profile_sync.py --model qwen2-0.5b --train fsdp --rollout hf \
        --rollout-options '{"dtype": "bfloat16"}'
    python3 tools/gpu/profile_sync.py --train deepspeed --train-options '{"zero_stage": 3}' --rollout sglang \
        --rollout-options '{"dtype": "bfloat16"}' --offload optimizer,grads     # the offload beside SGLang

Prints rank 0's switch report, the allocator's settings, and the operators sorted by host time and by device
time. A tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from gearshift import dist as gdist, registry
from gearshift.hybrid import HybridActor
from gearshift.models import resolve_model


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
    rollout = registry.create("rollout", args.rollout, model=path, **json.loads(args.rollout_options))
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
