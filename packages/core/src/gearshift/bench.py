"""Benchmarks: switch latency beside its baselines, rollout tokens/s, train steps/s, tokens/s and padding.

Every figure is measured in the same run as the baselines it is compared with:
the naive resharder (a safetensors file round trip), the copy limit (a plain
copy of the same bytes on the same device; with several ranks, plus an exchange
of the bytes that cross ranks, one message per peer, over the same process
group) and the rollout engine's own load
of the same weights from memory (its fastest path, with no export before it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import dist as gdist, registry
from .hybrid import HybridActor
from .profiler import SwitchReport, median_report, peak_memory_bytes, reset_peak_memory
from .reshard import AdapterResharder, NaiveResharder, StreamingResharder, export_weights
from .weights import WeightBucket


SYNC_PHASES = ("export", "load", "share")


def _sync_seconds(report: SwitchReport) -> float:
    return sum(p.seconds for p in report.phases if p.name in SYNC_PHASES)


@dataclass
class SwitchBench:
    """Medians of N switches of one pair, and the baselines measured beside them."""

    train: str
    rollout: str
    model: str
    bytes: int
    to_rollout: SwitchReport
    to_train: SwitchReport
    naive: SwitchReport
    copy_s: float
    engine_load_s: float
    pcie_s: float | None = None  # the same bytes from pinned host memory to the device (GPU only)
    #: switches that sent a LoRA trainer's adapter alone (`AdapterResharder`), where the pair can
    adapter: SwitchReport | None = None
    #: one batched copy (`torch._foreach_copy_`) of the same tensors: what a sync with no host work per tensor
    #: would take; and how many tensors a sync moves
    foreach_s: float | None = None
    tensors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sync_s(self) -> float:
        return _sync_seconds(self.to_rollout)

    @property
    def shared(self) -> bool:
        """The rollout engine served from the trainer's tensors: the sync copied nothing."""
        return self.to_rollout.phase("share") is not None

    @property
    def adapter_sync_s(self) -> float | None:
        return None if self.adapter is None else _sync_seconds(self.adapter)

    @property
    def adapter_bytes(self) -> int | None:
        return None if self.adapter is None else self.adapter.phase("load").bytes

    @property
    def host_us_per_tensor(self) -> float | None:
        """Microseconds per tensor the sync takes beyond one batched copy of the same tensors: its host work."""
        if self.foreach_s is None or not self.tensors:
            return None
        return max(self.sync_s - self.foreach_s, 0.0) / self.tensors * 1e6

    @property
    def naive_s(self) -> float:
        return sum(p.seconds for p in self.naive.phases if p.name in ("save", "load"))

    def ratios(self) -> dict[str, float]:
        return {
            "sync_over_copy": self.sync_s / self.copy_s if self.copy_s else float("inf"),
            "sync_over_engine_load": self.sync_s / self.engine_load_s if self.engine_load_s else float("inf"),
            "naive_over_sync": self.naive_s / self.sync_s if self.sync_s else float("inf"),
        }

    def to_dict(self) -> dict:
        return {
            "train": self.train, "rollout": self.rollout, "model": self.model, "bytes": self.bytes,
            "shared": self.shared, "sync_s": self.sync_s, "naive_s": self.naive_s, "copy_s": self.copy_s,
            "engine_load_s": self.engine_load_s, "pcie_s": self.pcie_s, **self.ratios(),
            "to_rollout": self.to_rollout.to_dict(), "to_train": self.to_train.to_dict(),
            "naive": self.naive.to_dict(), "adapter_sync_s": self.adapter_sync_s, "adapter_bytes": self.adapter_bytes,
            "foreach_s": self.foreach_s, "tensors": self.tensors, "host_us_per_tensor": self.host_us_per_tensor,
            "adapter": self.adapter.to_dict() if self.adapter is not None else None, **self.extra,
        }

    def table(self) -> str:
        r = self.ratios()
        lines = [
            f"switch benchmark: train={self.train} rollout={self.rollout} model={self.model} "
            f"({self.bytes / 1e6:.1f} MB of weights)",
            self.to_rollout.table(), self.to_train.table(),
            "",
            f"{'sync (export + share), median':<38}{self.sync_s:10.4f} s  shared, no bytes copied" if self.shared else
            f"{'sync (export + load), median':<38}{self.sync_s:10.4f} s  {self.bytes / self.sync_s / 1e9:6.2f} GB/s",
            f"{'naive resharder (file round trip)':<38}{self.naive_s:10.4f} s  {r['naive_over_sync']:6.1f}x the sync",
            f"{'copy limit (plain copy, same bytes)':<38}{self.copy_s:10.4f} s  sync is {r['sync_over_copy']:.2f}x"
            + (" (with the exchange between ranks)" if gdist.world_size() > 1 else ""),
            f"{'own load (the engine alone)':<38}{self.engine_load_s:10.4f} s  "
            f"sync is {r['sync_over_engine_load']:.2f}x",
        ]
        if self.foreach_s is not None:
            lines.append(f"{'one batched copy (_foreach_copy_)':<38}{self.foreach_s:10.4f} s  sync is "
                         f"{self.sync_s / max(self.foreach_s, 1e-9):.2f}x; host work "
                         f"{self.host_us_per_tensor:.1f} us per tensor ({self.tensors} tensors)")
        if self.pcie_s is not None:
            lines.append(f"{'PCIe (pinned host to device)':<38}{self.pcie_s:10.4f} s  "
                         f"sync is {self.sync_s / self.pcie_s:.2f}x")
        if self.adapter is not None:
            lines.append(f"{'adapter sync (the adapter alone)':<38}{self.adapter_sync_s:10.4f} s  "
                         f"{self.adapter_bytes / 1e6:.2f} MB instead of {self.bytes / 1e6:.1f} MB")
        if gdist.world_size() > 1 and "from_other_ranks" in self.extra:
            layouts = f"this rank, train {self.extra['train_mesh']} -> rollout {self.extra['rollout_mesh']}"
            lines.append(f"{layouts:<38}{self.extra['from_other_ranks'] / 1e6:10.3f} MB from other ranks, "
                         f"{self.extra['to_other_ranks'] / 1e6:.3f} MB to them")
        if "whole_bytes" in self.extra:
            whole, s = self.extra["whole_bytes"], self.extra["whole_sync_s"]
            lines.append(f"{'received per rank, slices declared':<38}{self.bytes / 1e6:10.3f} MB  "
                         f"{self.bytes / whole:.3f}x the {whole / 1e6:.3f} MB of whole weights "
                         f"({self.extra['whole_from_other_ranks'] / 1e6:.3f} MB of them from other ranks)")
            lines.append(f"{'sync with whole weights declared':<38}{s:10.4f} s  sync is {self.sync_s / s:.2f}x")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> bool:
        from .profiler import pyplot

        plt = pyplot()
        if plt is None:
            return False
        bars = {
            "gearshift\n(to rollout)": [(p.name, p.seconds) for p in self.to_rollout.phases],
            "naive": [(p.name, p.seconds) for p in self.naive.phases if p.name in ("save", "load")],
            "copy limit": [("copy", self.copy_s)],
            "engine load": [("engine load", self.engine_load_s)],
        }
        if self.adapter is not None:
            bars["adapter\nsync"] = [(p.name, p.seconds) for p in self.adapter.phases if p.name in SYNC_PHASES]
        fig, ax = plt.subplots(figsize=(7, 4))
        colors: dict[str, Any] = {}
        cmap = plt.get_cmap("tab10")
        for i, (label, parts) in enumerate(bars.items()):
            bottom = 0.0
            for name, secs in parts:
                color = colors.setdefault(name, cmap(len(colors) % 10))
                ax.bar(i, secs, bottom=bottom, color=color, label=name if name not in ax.get_legend_handles_labels()[1] else None)
                bottom += secs
        ax.set_xticks(range(len(bars)), list(bars))
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"switch: {self.train} -> {self.rollout}, {self.bytes / 1e6:.0f} MB")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return True


def _resolve(model: str) -> str:
    """The model's folder, built by rank 0 alone (transformers writes a model from the main process only)."""
    from .models import resolve_model

    return gdist.broadcast_object(resolve_model(model) if gdist.rank() == 0 else None)


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gdist.synchronize()
        t0 = time.perf_counter()
        fn()
        gdist.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    # The rollout engine's own fastest load: the same weights, already whole in memory, in one call.
    full = {n: t.detach().clone() for b in export_weights(train, plan.dst) for n, t in b.items()}
    rollout.wake(["weights"])
    engine_load_s = _median_seconds(lambda: rollout.own_load([WeightBucket(full)]), max(switches, 1))
    rollout.sleep(["weights", "kv_cache"])
    # The copy limit: the same bytes copied once, tensor by tensor, on the same device; with several
    # ranks, plus the bytes that cross ranks exchanged over the same process group, one message per peer
    # (and, for a trainer that gathers its weights to export them, one all-gather per bucket).
    src = list(full.values())
    dst = [torch.empty_like(t) for t in src]
    exchange = _exchange(plan, src[0].device if src else train.device, gathers=not train.can_lend_weights)
    copy_s = _median_seconds(lambda: ([d.copy_(s) for d, s in zip(dst, src)], exchange()), max(switches, 3))
    foreach_s = _median_seconds(lambda: torch._foreach_copy_(dst, src), max(switches, 3)) if src else None
    pcie_s = None
    if src and src[0].device.type == "cuda":  # what a sync that kept the weights in host memory would pay
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in src]
        pcie_s = _median_seconds(lambda: [d.copy_(h, non_blocking=True) for d, h in zip(dst, host)], max(switches, 3))
        del host
    sent, received = plan.peer_bytes(gdist.rank())
    return SwitchBench(*labels, plan.bytes_received(gdist.rank()), median_report(ups), median_report(downs),
                       median_report(naive), copy_s, engine_load_s, pcie_s, adapter, foreach_s, len(src),
                       extra={"train_mesh": str(plan.src.mesh), "rollout_mesh": str(plan.dst.mesh),
                              "from_other_ranks": sum(received.values()), "to_other_ranks": sum(sent.values())})


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
    from .models import resolve_model

    gdist.init()
    path = _resolve(model)
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


def _switch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", default="torch", help="train backend (default torch)")
    p.add_argument("--rollout", default="hf", help="rollout backend (default hf)")
    p.add_argument("--model", default="bench100m", help="model folder or preset (default bench100m, ~110M params)")
    p.add_argument("--switches", type=int, default=5, help="full switches to take the median of (default 5)")
    p.add_argument("--naive-switches", type=int, default=3, help="switches with the naive resharder (default 3)")
    p.add_argument("--share", choices=SHARE_CHOICES, default="auto",
                   help="serve rollout from the trainer's tensors: auto (when the pair can; default), "
                        "on (fail if it cannot), off (always copy)")
    p.add_argument("--offload", default="auto",
                   help="auto (move only what memory asks for; default), none, or tags to move every switch "
                        "(e.g. optimizer,grads: the rollout engine then sleeps and wakes every switch)")
    p.add_argument("--train-options", default="{}", help="JSON options for the train engine")
    p.add_argument("--rollout-options", default="{}", help="JSON options for the rollout engine")
    p.add_argument("--lora-r", type=int, default=0,
                   help="train LoRA adapters of this rank: the sync sends merged weights, and a rollout engine "
                        "that serves adapters (vllm) is also measured taking the adapter alone")
    p.add_argument("--against-whole", action="store_true",
                   help="also measure the rollout engine declaring whole weights (tp_slices=false), in the same run: "
                        "the bytes each rank receives with its tensor-parallel slices against whole weights")
    p.add_argument("--out", default="runs/bench", help="folder for the JSON and PNG (default runs/bench)")


SHARE_CHOICES = {"auto": None, "on": True, "off": False}


def _offload_arg(text: str) -> str | list[str]:
    text = text.strip()
    if text == "auto":
        return "auto"
    return [] if text == "none" else [t.strip() for t in text.split(",") if t.strip()]


def bench_switch(args: argparse.Namespace) -> int:
    bench = measure_switch(args.train, args.rollout, args.model, args.switches, args.naive_switches,
                           json.loads(args.train_options), json.loads(args.rollout_options),
                           share=SHARE_CHOICES[args.share], offload=_offload_arg(args.offload), lora_r=args.lora_r,
                           against_whole=args.against_whole)
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


def measure_rollout(names: list[str], model: str, prompts: int = 16, n: int = 4, max_tokens: int = 64,
                    repeats: int = 3, options: dict | None = None) -> list[dict]:
    """Generated tokens/s of each rollout backend on the same model and batch (sampling, fixed seed)."""
    from .rollout import SamplingParams
    from .models import resolve_model

    path = _resolve(model)
    batch = [[(7 * i + j) % 200 + 32 for j in range(8 + i % 5)] for i in range(prompts)]
    sampling = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0)
    rows = []
    for name in names:
        engine = registry.create("rollout", name, model=path, **(options or {}).get(name, {}))
        engine.generate(batch[:2], sampling)  # warm-up
        times, tokens = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = engine.generate(batch, sampling)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(r.token_ids) for r in out)
        secs = statistics.median(times)
        rows.append({"backend": name, "model": model, "sequences": len(batch) * n, "tokens": tokens,
                     "seconds": secs, "tokens_per_s": tokens / secs})
        engine.close()
    return rows


def train_batch(batch_size: int, seq_len: int, min_len: int | None = None, seed: int = 0):
    """Random rows, half prompt and half response, `seq_len` tokens each, or of lengths drawn uniformly
    from [min_len, seq_len] (right-padded to the longest)."""
    from .train import TrainBatch

    g = torch.Generator().manual_seed(seed)
    if min_len is None or min_len >= seq_len:
        lengths = [seq_len] * batch_size
    else:
        lengths = torch.randint(max(min_len, 2), seq_len + 1, (batch_size,), generator=g).tolist()
    prompts = [torch.randint(32, 200, (n // 2,), generator=g).tolist() for n in lengths]
    responses = [torch.randint(32, 200, (n - n // 2,), generator=g).tolist() for n in lengths]
    return TrainBatch.from_sequences(prompts, responses)


def step_peak_bytes(fn) -> int:
    """The most memory `fn` allocates beyond what was allocated when it started (activations, gradients):
    the CUDA allocator's count, or on a CPU the allocations torch's profiler records."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_train(names: list[str], model: str, batch_size: int = 16, seq_len: int = 64, steps: int = 3,
                  options: dict | None = None, *, min_len: int | None = None, micro_batch_size: int | None = None,
                  token_budgets: tuple[int, ...] = (0,), meshes: tuple[str, ...] = ("",)) -> list[dict]:
    """Optimizer steps/s and tokens/s of each train backend on the same model and batch, once per token
    budget (0: micro-batches of `micro_batch_size` rows, as wide as the batch; else rows packed by length
    into micro-batches of that many tokens, `max_tokens_per_micro_batch`, with no cap on their rows:
    `micro_batch_size` rows x `seq_len` is the budget that bounds memory as the fixed count does).

    tokens_per_s counts the batch's real tokens; pad_share is the share of padding in the tokens the
    engine computed (from its `pad_frac` metric; '-' for an engine that does not report it). Each of
    `meshes` ('' for the default, 'sp=2', 'tp=2', ...) gets its rows, every rank given the whole batch;
    step_peak_mb is what one step allocates beyond what it started with (activations, gradients),
    measured in an extra step.
    """
    from .models import resolve_model
    from .train import nll_loss

    gdist.init()
    path = _resolve(model)
    batch = train_batch(batch_size, seq_len, min_len)
    real_tokens = int(batch.lengths.sum())
    rows = []
    for name, budget, mesh in ((n, b, m) for n in names for b in token_budgets for m in meshes):
        reset_peak_memory()
        engine = registry.create("train", name, model=path, lr=1e-5,
                                 micro_batch_size=None if budget else micro_batch_size,
                                 max_tokens_per_micro_batch=budget or None, **(options or {}).get(name, {}),
                                 **({"mesh": mesh} if mesh else {}))
        metrics = engine.train_step(batch, nll_loss)  # warm-up
        secs = _median_seconds(lambda: engine.train_step(batch, nll_loss), steps)
        step_peak = step_peak_bytes(lambda: engine.train_step(batch, nll_loss))
        pad = metrics.get("pad_frac")
        rows.append({"backend": name, **({"mesh": str(engine.mesh)} if meshes != ("",) else {}),
                     "model": model, "batch": batch_size, "seq_len": seq_len,
                     "micro_batch_size": "-" if budget else micro_batch_size or "-", "max_tokens": budget or "-",
                     "micro_batches": int(metrics.get("micro_batches", 0)) or "-",
                     "pad_share": pad if pad is not None else "-",
                     "seconds_per_step": secs, "steps_per_s": 1 / secs, "tokens_per_s": real_tokens / secs,
                     "peak_gb": peak_memory_bytes() / 1e9, "step_peak_mb": step_peak / 2**20})
        engine.close()
    return rows


def _rollout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="hf", help="comma-separated rollout backends (e.g. hf,vllm)")
    p.add_argument("--model", default="small", help="model folder or preset (default small)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--options", default="{}", help="JSON: {backend: {engine options}}")


def _train_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="torch", help="comma-separated train backends (e.g. torch,fsdp)")
    p.add_argument("--model", default="small", help="model folder or preset (default small)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--min-len", type=int, default=None,
                   help="row lengths drawn uniformly from [min-len, seq-len] (default: all seq-len, no padding)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per micro-batch (default: all)")
    p.add_argument("--max-tokens-per-micro-batch", default="0",
                   help="comma-separated token budgets, one row each; 0: micro-batches of --micro-batch-size "
                        "rows; N: rows packed by length into N tokens (--micro-batch-size 8 --seq-len 256 "
                        "--max-tokens-per-micro-batch 0,2048 puts the two under the same memory bound side by side)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--options", default="{}", help="JSON: {backend: {engine options}}")
    p.add_argument("--mesh", action="append", default=None,
                   help="a train mesh to measure (repeat for several, e.g. --mesh dp=2 --mesh sp=2 under torchrun); "
                        "default: the backend's own")


def _print_rows(rows: list[dict]) -> None:
    if gdist.rank() != 0 or not rows:
        return
    keys = list(rows[0])
    cells = [keys] + [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for i, c in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


#: the phases of an RL step, as the controller times them (time/<phase>); the rest of a step is the loop's own
STEP_PHASES = ("rollout", "reward", "old_logprobs", "ref_logprobs", "values", "train", "switch_to_rollout",
               "switch_to_train")


def measure_steps(config_path: str | None, overrides: list[str], steps: int = 5, skip: int = 1) -> dict[str, Any]:
    """Run `steps` RL steps of a job (a config file and overrides, as `gearshift train` takes them) and return
    each phase's median seconds over the steps after the first `skip`, the step's, and the loop's own: the
    time of a step that is in no phase."""
    from .rl.config import load_config
    from .rl.controller import Controller

    cfg = load_config(config_path, ["run.output_dir=runs/bench/step", *overrides, f"run.steps={steps}", "run.checkpoint_every=0", "run.resume=never",
                                    "run.progress=false", "run.samples_per_step=0", "run.plot=false",
                                    "run.tensorboard=false"])
    controller = Controller(cfg)
    rows = [controller.run_step() for _ in range(steps)]
    kept = rows[skip:] or rows
    out: dict[str, Any] = {"steps": len(kept)}
    for name in ("step", *STEP_PHASES):
        vals = [r[f"time/{name}"] for r in kept if f"time/{name}" in r]
        if vals:
            out[name] = statistics.median(vals)
    loop = [r["time/step"] - sum(r.get(f"time/{n}", 0.0) for n in STEP_PHASES) for r in kept]
    out["loop"] = statistics.median(loop)
    out["tokens_per_s"] = statistics.median(r["rollout/tokens_per_s"] for r in kept)
    controller.logger.close()
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
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (optional; the default job without one)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for gearshift train")
    p.add_argument("--steps", type=int, default=6, help="steps to run (default 6)")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the medians (default 1)")
    p.add_argument("--out", default="", help="write the medians to this JSON file")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    _step_args(sub.add_parser("step", help="an RL step's phases (rollout, reward, old logprobs, switch, train, the "
                                           "loop's own), medians over N steps of a job"))
    _switch_args(sub.add_parser("switch", help="switch latency of a pair beside naive, copy and engine-load baselines"))
    _rollout_args(sub.add_parser("rollout", help="generated tokens/s of rollout backends, side by side"))
    _train_bench_args(sub.add_parser("train", help="train steps/s, tokens/s and padding of train backends, "
                                                   "side by side"))


def bench_command(args: argparse.Namespace) -> int:
    if args.what == "switch":
        return bench_switch(args)
    if args.what == "step":
        return bench_step(args)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    options = json.loads(args.options)
    if args.what == "rollout":
        _print_rows(measure_rollout(names, args.model, args.prompts, args.n, args.max_tokens, args.repeats, options))
    else:
        budgets = tuple(int(b) for b in args.max_tokens_per_micro_batch.split(",") if b.strip())
        _print_rows(measure_train(names, args.model, args.batch_size, args.seq_len, args.steps, options,
                                  min_len=args.min_len, micro_batch_size=args.micro_batch_size,
                                  token_budgets=budgets or (0,), meshes=tuple(args.mesh or ("",))))
    return 0
