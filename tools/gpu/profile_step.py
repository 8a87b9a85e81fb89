#!/usr/bin/env python3
"""Where a GRPO step waits on the device: torch.profiler over one step of a run, after warm-up steps.

    python3 tools/gpu/profile_step.py --steps 2 model.path=qwen2-0.5b rollout.backend=vllm train.backend=fsdp \
        rollout.max_tokens=256 run.prompts_per_step=32 rollout.n=8

The arguments after the options are `gearshift train` overrides. Prints how often the step read a tensor to
the host (`aten::_local_scalar_dense`, behind every `float()`, `.item()` and `bool()` of a tensor), the
driver's synchronisations and device-to-host copies, each with their host time, and the call sites that read
most (traced in a second step: on a GPU only reads of device tensors, which wait for the device; on a CPU every
read), so that a read per sample or per micro-batch shows as a count that grows with the batch. Runs on a CPU
too (no driver events there). A tool, not a test. Seen on a CPU (hf + torch, the default job): 71 reads a step
for 256 samples, the per-row reads all of host copies made once per batch.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from contextlib import contextmanager

import torch

#: events that make the host wait for the device, or that read from it
WAITS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "cudaMemcpyAsync")


#: the Tensor methods that copy a value to the host (and wait for the device to compute it)
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextmanager
def read_sites(sites: collections.Counter, device_only: bool):
    """Count where gearshift reads a tensor to the host: the first frame in gearshift above each read."""
    real = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        def read(t, *args, **kwargs):
            if not device_only or t.device.type != "cpu":
                frames = [f for f in traceback.extract_stack()[:-1] if "gearshift" in f.filename
                          and "profile_step" not in f.filename]
                where = frames[-1] if frames else None
                sites[f"{where.filename.split('src/')[-1]}:{where.lineno} {where.name} ({name})" if where
                      else f"(outside gearshift) ({name})"] += 1
            return real[name](t, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="steps run before the profiled one")
    p.add_argument("--top", type=int, default=12, help="call sites to list")
    p.add_argument("--out", help="write the counts as JSON here")
    args, overrides = p.parse_known_args()
    from gearshift.rl.config import load_config
    from gearshift.rl.controller import Controller

    base = ["run.checkpoint_every=0", "run.progress=false", "run.plot=false", "run.tensorboard=false",
            "run.samples_per_step=0", "run.resume=never", "run.output_dir=runs/profile-step"]
    cfg = load_config(None, [*base, f"run.steps={args.steps + 2}", *overrides])
    controller = Controller(cfg)
    for _ in range(args.steps):
        controller.run_step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sites = collections.Counter()
    with torch.profiler.profile(activities=activities) as prof:
        metrics = controller.run_step()
    # a second step, its reads traced to their call sites (the tracing itself slows the host)
    with read_sites(sites, device_only=torch.cuda.is_available()):
        controller.run_step()
    events = prof.events()
    counts, host_us = collections.Counter(), collections.Counter()
    for e in events:
        if e.name in WAITS:
            counts[e.name] += 1
            host_us[e.name] += e.cpu_time_total
    samples = cfg.run.prompts_per_step * cfg.rollout.n
    print(f"one step: {metrics['time/step']:.2f} s for {samples} samples, "
          f"{int(metrics.get('train/micro_batches', 0))} micro-batches")
    for name in WAITS:
        if counts[name]:
            print(f"{name:28s} {counts[name]:6d} calls  {host_us[name] / 1e3:9.2f} ms host")
    print(f"tensor reads to the host per sample: {counts['aten::_local_scalar_dense'] / samples:.2f}")
    where = "device tensors" if torch.cuda.is_available() else "tensors (no GPU: every read, CPU ones too)"
    print(f"where gearshift reads {where} to the host, in the next step, most first:")
    for site, n in sites.most_common(args.top):
        print(f"  {n:5d}  {site}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"counts": counts, "host_us": host_us, "sites": dict(sites.most_common(args.top)),
                       "samples": samples, "metrics": metrics}, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
