#!/usr/bin/env python3
"""Where an fsdp -> sglang sync's time goes: the host's side against the scheduler's, over a few switches.

    python3 tools/gpu/profile_sglang_load.py --model qwen2-7b --train-options '{"dtype": "bfloat16"}'

After warm-up switches, each switch to rollout is timed by its `SwitchReport` (export, load) and the scheduler
reports the parts of the load it ran itself (`SGLangRolloutEngine.load_times`: receive, check, loader, copy,
flush (the update's own, run while the GPU copies), wait); the load's rest is the host's side of the calls
(serializing, ZeroMQ, waiting for the scheduler's loop).
Prints each part's median with the update's prefix-cache flush in the scheduler (the default) and by the host,
the same bytes copied once by `_foreach_copy_` in this process for scale, and the round trips alone (a call that
does nothing much, the flush each way). Runs on a CPU too (a tiny model). A tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from gearshift import dist as gdist, registry
from gearshift.bench.timing import median_seconds
from gearshift.hybrid import HybridActor
from gearshift.models import resolve_model

PARTS = ("receive", "check", "loader", "copy", "flush", "wait")


def foreach_copy_s(tensors: list[torch.Tensor], repeats: int) -> float:
    """Median seconds of one `_foreach_copy_` of `tensors` into fresh tensors like them (synchronized)."""
    dsts = [torch.empty_like(t) for t in tensors]
    return median_seconds(lambda: torch._foreach_copy_(dsts, tensors), repeats)


def switch_parts(actor, rollout, switches: int) -> dict[str, float]:
    """Medians over `switches` switches to rollout (and back) of the sync's export and load and of the parts of
    the load the scheduler timed (seconds; "calls": how many calls into it)."""
    rows = []
    for _ in range(switches):
        report = actor.to_rollout()
        phases = {ph.name: ph.seconds for ph in report.phases}
        rows.append({"export": phases.get("export", 0.0), "load": phases.get("load", 0.0), **rollout.load_times()})
        actor.to_train()
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ("export", "load", "calls", *PARTS)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--train", default="fsdp")
    p.add_argument("--train-options", default="{}", help="JSON: train engine options")
    p.add_argument("--rollout-options", default='{"dtype": "bfloat16"}', help="JSON: sglang engine options")
    p.add_argument("--switches", type=int, default=5)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions of the host's side with the most own time over the switches "
                        "(cProfile, which slows Python down)")
    args = p.parse_args()
    gdist.init()
    path = resolve_model(args.model)
    train = registry.create("train", args.train, model=path, **json.loads(args.train_options))
    rollout = registry.create("rollout", "sglang", model=path, **json.loads(args.rollout_options))
    actor = HybridActor(train, rollout, offload=())
    for _ in range(2):
        actor.to_rollout()
        actor.to_train()
    lines = [f"{args.model}: {args.train} -> sglang, medians of {args.switches} switches (ms)"]
    # the update's prefix-cache flush in the scheduler after its last call (the default), then by the host
    for fused in (True, False):
        rollout.flush_in_scheduler = fused
        med = switch_parts(actor, rollout, args.switches)
        inside = sum(med[k] for k in PARTS)
        where = "in the scheduler, after the last call" if fused else "by the host, a call of its own"
        lines += [f"  the flush {where}",
                  f"  export (host)                     {med['export'] * 1e3:8.2f}",
                  f"  load (host, whole)                {med['load'] * 1e3:8.2f}   {med['calls']:.0f} call(s)"]
        lines += [f"    {k:30s}  {med[k] * 1e3:8.2f}   (in the scheduler)" for k in PARTS]
        lines.append(f"    {'round trips and the host side':30s}  {(med['load'] - inside) * 1e3:8.2f}")
    rollout.flush_in_scheduler = True
    tensors = [t for t in train.model.parameters()] if hasattr(train, "model") else []
    if tensors:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in (x.data for x in tensors)]
        lines.append(f"  one _foreach_copy_ of the trainer's {len(local)} tensors here: "
                     f"{foreach_copy_s(local, 5) * 1e3:.2f}")
    # the round trips of an update beside the copy, each alone on an idle engine: a call into the scheduler that
    # does nothing much (a reseed), and the prefix-cache flush, as the host asks for it and as a call of the
    # scheduler's with and without emptying torch's cache there
    rpc = rollout._engine.collective_rpc
    calls = {"a call into the scheduler (a reseed)": lambda: rpc("gearshift_reseed", seed=0),
             "SGLang's cache flush, as the host asks": rollout._flush,
             "flush_cache() called in the scheduler": lambda: rpc("flush_cache"),
             "flush_cache(empty_cache=False) there": lambda: rpc("flush_cache", empty_cache=False)}
    lines += [f"  {name:42s} {median_seconds(call, args.switches) * 1e3:8.2f}" for name, call in calls.items()]
    if args.cprofile:
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        switch_parts(actor, rollout, args.switches)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        lines.append(f"  the host's side of {args.switches} switches under cProfile:\n{text.getvalue()}")
    if gdist.rank() == 0:
        print("\n".join(lines), flush=True)
    rollout.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
