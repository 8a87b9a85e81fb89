"""The switch benchmark: a pair's switch latency beside its baselines, in the same run.

The baselines: the naive resharder (a safetensors file round trip), the copy
limit (a plain copy of the same bytes on the same device; with several ranks,
plus an exchange of the bytes that cross ranks, one message per peer, over the
same process group) and the rollout engine's own load of the same weights from
memory (its fastest path, with no export before it: `OwnLoad.own_load` where
the engine has one, else its `update_weights`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from .. import dist as gdist, registry
from ..hybrid import HybridActor
from ..options import count, json_object, positive_int
from ..profiler import SwitchReport, median_report
from ..reshard import AdapterResharder, NaiveResharder, StreamingResharder, export_weights
from ..weights import WeightBucket
from .report import SwitchBench
from .timing import median_seconds, resolve_once


@runtime_checkable
class OwnLoad(Protocol):
    """A rollout engine with a loading path of its own, which the switch benchmark compares a sync with."""

    def own_load(self, buckets: Iterable[WeightBucket]) -> int:
        """Load the buckets the engine's own way from memory, with nothing of gearshift's in between (no
        in-place views, no checks beyond the engine's); returns the bytes of the tensors handed in."""


def switch_settings(share: str, offload: str) -> tuple[bool | None, str | list[str]]:
    """`--share` and `--offload` read as the run config reads `switch.share` and `switch.offload`: what
    `StreamingResharder(share=...)` and `HybridActor(offload=...)` take."""
    from ..rl.config import Config, SwitchConfig
    from ..rl.config import SHARE

    cfg = Config(switch=SwitchConfig(share=share, offload=offload))
    return SHARE[cfg.switch.share], cfg.offload_tags()


def _exchange(plan, device: torch.device, gathers: bool = False):
    """A callable that sends and receives, in one batch of one message per peer, as many bytes
    (in the rollout dtypes) as the plan moves between this rank and each other rank. `gathers`: the
    trainer gathers its weights per bucket to export them (ZeRO-3): one all-gather per bucket too."""
    if not gdist.is_distributed():
        return lambda: None
    import torch.distributed as dist

    sent, received = plan.peer_bytes(gdist.rank())
    out = {peer: torch.empty(n, dtype=torch.uint8, device=device) for peer, n in sent.items()}
    into = {peer: torch.empty(n, dtype=torch.uint8, device=device) for peer, n in received.items()}
    world = gdist.world_size()
    gather = [(torch.empty(b.nbytes // world, dtype=torch.uint8, device=device),
               torch.empty(b.nbytes // world * world, dtype=torch.uint8, device=device))
              for b in plan.buckets] if gathers else []

    def run() -> None:
        for mine, whole in gather:
            dist.all_gather_into_tensor(whole, mine)
        ops = [dist.P2POp(dist.isend, buf, peer) for peer, buf in out.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in into.items()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    return run


def _round_trips(actor: HybridActor, times: int, bar,
                 warm_up: bool = False) -> tuple[list[SwitchReport], list[SwitchReport]]:
    """`times` round trips of `actor`, after one more that is not kept (`warm_up`: first-touch allocations are
    not what a steady run pays); the reports of each way."""
    ups, downs = [], []
    for i in range(times + int(warm_up)):
        up, down = actor.to_rollout(), actor.to_train()
        if i or not warm_up:
            ups.append(up)
            downs.append(down)
        bar.update(1)
    return ups, downs


def measure_pair(train, rollout, switches: int = 5, naive_switches: int = 3, naive_dir: str | None = None,
                 progress: bool = False, labels: tuple[str, str, str] = ("", "", ""),
                 share: bool | None = None, offload: str | list[str] = "auto") -> SwitchBench:
    """Switch a built pair `switches` times, then the baselines on the same engines; return the medians.

    `share` goes to `StreamingResharder`: None shares the trainer's tensors when the pair can.
    `offload` goes to `HybridActor`: "auto" moves only what memory asks for (with no training
    between switches, a GPU keeps the rollout engine awake); tags force the full switch, the rollout
    engine put to sleep and woken every time. A LoRA trainer beside an engine that serves adapters
    (built with `max_lora_rank`) also takes `switches` syncs of the adapter alone (`SwitchBench.adapter`).
    """
    from tqdm import tqdm

    actor = HybridActor(train, rollout, StreamingResharder(share=share), offload=offload)
    by_adapter = AdapterResharder.refusal(train, rollout) is None
    bar = tqdm(total=(switches + 1) * (2 if by_adapter else 1) + naive_switches, desc="switches",
               disable=not progress or gdist.rank() != 0)
    ups, downs = _round_trips(actor, switches, bar, warm_up=True)
    naive, _ = _round_trips(HybridActor(train, rollout, NaiveResharder(directory=naive_dir)), naive_switches, bar)
    adapter = None
    if by_adapter:
        adapter_actor = HybridActor(train, rollout, AdapterResharder(), offload=offload)
        adapter_ups, _ = _round_trips(adapter_actor, switches, bar, warm_up=True)
        adapter = median_report(adapter_ups)
    bar.close()
    plan = actor.plan
    base = _baselines(train, rollout, plan, switches)
    sent, received = plan.peer_bytes(gdist.rank())
    return SwitchBench(*labels, plan.bytes_received(gdist.rank()), median_report(ups), median_report(downs),
                       median_report(naive), base["copy_s"], base["engine_load_s"], base["pcie_s"], adapter,
                       base["foreach_s"], base["tensors"],
                       extra={"train_mesh": str(plan.src.mesh), "rollout_mesh": str(plan.dst.mesh),
                              "rollout_load_path": getattr(rollout, "load_path", None),
                              "from_other_ranks": sum(received.values()), "to_other_ranks": sum(sent.values())})


def _baselines(train, rollout, plan, switches: int) -> dict[str, Any]:
    """The baselines of a sync of `plan`, on the same engines and bytes: the rollout engine's own load,
    the copy limit, one batched copy and (on a GPU) the copy from pinned host memory."""
    # The rollout engine's own fastest load: the same weights, already whole in memory, in one call.
    full = {n: t.detach().clone() for b in export_weights(train, plan.dst) for n, t in b.items()}
    rollout.wake(["weights"])
    load = rollout.own_load if isinstance(rollout, OwnLoad) else rollout.update_weights
    engine_load_s = median_seconds(lambda: load([WeightBucket(full)]), max(switches, 1))
    rollout.sleep(["weights", "kv_cache"])
    # The copy limit: the same bytes copied once, tensor by tensor, on the same device; with several
    # ranks, plus the bytes that cross ranks exchanged over the same process group, one message per peer
    # (and, for a trainer that gathers its weights to export them, one all-gather per bucket).
    src = list(full.values())
    dst = [torch.empty_like(t) for t in src]
    exchange = _exchange(plan, src[0].device if src else train.device, gathers=not train.can_lend_weights)
    copy_s = median_seconds(lambda: ([d.copy_(s) for d, s in zip(dst, src)], exchange()), max(switches, 3))
    foreach_s = median_seconds(lambda: torch._foreach_copy_(dst, src), max(switches, 3)) if src else None
    pcie_s = None
    if src and src[0].device.type == "cuda":  # what a sync that kept the weights in host memory would pay
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in src]
        pcie_s = median_seconds(lambda: [d.copy_(h, non_blocking=True) for d, h in zip(dst, host)], max(switches, 3))
        del host
    return {"engine_load_s": engine_load_s, "copy_s": copy_s, "foreach_s": foreach_s, "pcie_s": pcie_s,
            "tensors": len(src)}


def measure_switch(train_name: str, rollout_name: str, model: str, switches: int = 5, naive_switches: int = 3,
                   train_options: dict | None = None, rollout_options: dict | None = None,
                   naive_dir: str | None = None, progress: bool = True, share: bool | None = None,
                   offload: str | list[str] = "auto", lora_r: int = 0, against_whole: bool = False) -> SwitchBench:
    """Build the pair on `model` (a folder or preset) and measure it with `measure_pair`.

    `lora_r`: the trainer trains LoRA adapters of this rank, and a rollout engine that serves adapters
    is built to take them, so the adapter sync is measured beside the merged one. `against_whole`: the
    rollout engine is built again declaring whole weights (`tp_slices=False`) and measured too, so the
    bytes each rank receives with its tensor-parallel slices declared compare with whole weights.
    """
    gdist.init()
    path = resolve_once(model)
    train_options, rollout_options = dict(train_options or {}), dict(rollout_options or {})
    if lora_r:
        train_options["lora_r"] = lora_r
        if registry.load("rollout", rollout_name).can_load_adapters:
            rollout_options["max_lora_rank"] = lora_r
    train = registry.create("train", train_name, model=path, **train_options)
    rollout = registry.create("rollout", rollout_name, model=path, **rollout_options)
    try:
        bench = measure_pair(train, rollout, switches, naive_switches, naive_dir, progress,
                             (train_name, rollout_name, model), share, offload)
        if against_whole:
            rollout.close()
            rollout = registry.create("rollout", rollout_name, model=path, **rollout_options, tp_slices=False)
            whole = measure_pair(train, rollout, switches, naive_switches, naive_dir, progress,
                                 (train_name, rollout_name, model), share, offload)
            bench.extra.update(whole_bytes=whole.bytes, whole_sync_s=whole.sync_s,
                               whole_from_other_ranks=whole.extra["from_other_ranks"],
                               whole_to_rollout=whole.to_rollout.to_dict())
        return bench
    finally:
        train.close()
        rollout.close()


def add_switch_arguments(p: argparse.ArgumentParser) -> None:
    from ..rl.config import SHARE

    p.add_argument("--train", default="torch", help="train backend (default torch)")
    p.add_argument("--rollout", default="hf", help="rollout backend (default hf)")
    p.add_argument("--model", default="bench100m", help="model folder or preset (default bench100m, ~110M params)")
    p.add_argument("--switches", type=positive_int, default=5, help="full switches to take the median of (default 5)")
    p.add_argument("--naive-switches", type=count, default=3, help="switches with the naive resharder (default 3)")
    p.add_argument("--share", choices=tuple(SHARE), default="auto",
                   help="serve rollout from the trainer's tensors: auto (when the pair can; default), "
                        "on (fail if it cannot), off (always copy)")
    p.add_argument("--offload", default="auto",
                   help="auto (move only what memory asks for; default), none, or tags to move every switch "
                        "(e.g. optimizer,grads: the rollout engine then sleeps and wakes every switch)")
    p.add_argument("--train-options", type=json_object, default="{}", help="JSON options for the train engine")
    p.add_argument("--rollout-options", type=json_object, default="{}", help="JSON options for the rollout engine")
    p.add_argument("--lora-r", type=count, default=0,
                   help="train LoRA adapters of this rank: the sync sends merged weights, and a rollout engine "
                        "that serves adapters (vllm) is also measured taking the adapter alone")
    p.add_argument("--against-whole", action="store_true",
                   help="also measure the rollout engine declaring whole weights (tp_slices=false), in the same run: "
                        "the bytes each rank receives with its tensor-parallel slices against whole weights")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON and PNG (default runs/bench)")


def bench_switch(args: argparse.Namespace) -> int:
    share, offload = switch_settings(args.share, args.offload)
    bench = measure_switch(args.train, args.rollout, args.model, args.switches, args.naive_switches,
                           args.train_options, args.rollout_options,
                           share=share, offload=offload, lora_r=args.lora_r, against_whole=args.against_whole)
    if gdist.rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = (f"switch-{args.train}-{args.rollout}" + ("-copy" if args.share == "off" else "")
                + ("" if args.offload == "auto" else "-" + args.offload.replace(",", "+"))
                + (f"-lora{args.lora_r}" if args.lora_r else ""))
        (out / f"{stem}.json").write_text(json.dumps(bench.to_dict(), indent=2))
        bench.plot(out / f"{stem}.png")
        print(bench.table())
        print(f"\nwritten: {out / stem}.json, {out / stem}.png")
    return 0
