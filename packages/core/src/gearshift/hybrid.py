"""`HybridActor`: one train engine and one rollout engine sharing the ranks, and the switch between them.

train -> rollout: offload what training does not need, wake the rollout
weights, sync them, optionally offload the training params, wake the KV
cache, reset the prefix cache. rollout -> train: put the rollout engine to
sleep, bring the training state back. Every phase lands in a `SwitchReport`.

Memory decides what moves (`offload="auto"`, the default; memory.py): on a
GPU, train state leaves the device only when the rollout engine's memory does
not fit beside it, largest first (the weights only after the sync has read
them), and the rollout engine is put to sleep only when training does not fit
beside it (measured on the step before); host buffers for what will move are
allocated at start. Before the rollout engine maps memory, torch's cached,
unused blocks go back to the driver: an engine with an allocator of its own
(vLLM's sleep mode, SGLang's memory saver) cannot use them, so the plan counts
only memory really free. Given tags, `offload` always moves exactly those (and
their host buffers are allocated at start). On a CPU the train state is in host
memory already, and the rollout engine always sleeps.

When the plan lets the rollout engine serve from the trainer's own tensors
(`ReshardPlan.share`), its weights are not woken (they need no memory of their
own) and the sync hands tensors over instead of copying them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import dist as gdist
from .memory import MARGIN, GiB, device_free, plan_offload, release_cached
from .profiler import PhaseTimer, SwitchReport
from .reshard import Resharder, StreamingResharder
from .rollout import RolloutEngine, Rollout, SamplingParams
from .train import LossFn, TrainBatch, TrainEngine

MODES = ("train", "rollout")


class ModeError(RuntimeError):
    """An engine was used while the actor is in the other mode."""


class HybridActor:
    """Switches one policy between its train engine and its rollout engine."""

    def __init__(
        self,
        train: TrainEngine,
        rollout: RolloutEngine,
        resharder: Resharder | None = None,
        *,
        offload: Sequence[str] | str = "auto",
        offload_params: bool = False,
    ) -> None:
        self.train = train
        self.rollout = rollout
        self.resharder = resharder or StreamingResharder()
        self.auto = offload == "auto"
        self.offload_tags = () if self.auto else tuple([offload] if isinstance(offload, str) else offload)
        self.offload_params = offload_params
        self.on_gpu = torch.device(train.device).type == "cuda"
        self.plan = self.resharder.plan(train, rollout)  # once: a switch does no discovery work
        if self.plan.share and offload_params:
            # the rollout engine would keep the offloaded params alive where they were
            if self.resharder.share:
                raise ValueError("offload_params=True cannot be combined with a resharder that shares weights "
                                 "(the rollout engine reads the very tensors that would be offloaded)")
            self.plan.share = False
        self.reports: list[SwitchReport] = []
        self.mode = "train"
        awake = rollout.resident_bytes()
        #: device bytes the rollout engine takes awake (its weights are the trainer's when shared); None: unknown
        self.rollout_need = (sum(v for k, v in awake.items() if not (self.plan.share and k == "weights"))
                             if awake else None)
        self.rollout.sleep(["kv_cache", "weights"])
        self.rollout_awake = False
        self._offloaded: tuple[str, ...] = ()  # the tags the last switch to rollout moved to host memory
        self._train_peak: int | None = None  # device bytes the last training phase took beyond its state
        self._squeezed = False  # a train phase beside the awake rollout engine had smaller micro-batches for it
        #: host bytes allocated at start for what the switches will move (0: nothing will move, or unknown)
        self.host_reserved = self._reserve_host() if self.on_gpu else 0

    def _plan_tags(self, report: SwitchReport) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What to offload on the way to rollout, before the sync and after it: the given tags, or what memory
        asks for (the weights, which the sync reads, only after it)."""
        if not self.auto:
            return tuple(t for t in self.offload_tags if t != "params"), ("params",) * ("params" in self.offload_tags)
        if not self.on_gpu:
            report.notes.append("offload: none (the train state is in host memory already)")
            return (), ()
        sizes = self.train.state_bytes()
        if self.rollout_need is None or not sizes:
            report.notes.append("offload: optimizer, grads (the engines report no sizes to plan with)")
            return ("optimizer", "grads"), ()
        if self.rollout_awake:
            report.notes.append("offload: none (the rollout engine stayed awake beside training)")
            return (), ()
        plan = self._offload_plan(sizes)
        report.notes.append(f"offload: {plan.note}")
        return tuple(t for t in plan.tags if t != "params"), ("params",) * ("params" in plan.tags)

    def _offload_plan(self, sizes: dict[str, int]):
        # torch's cached blocks go back to the driver before the rollout engine wakes: count them as free here,
        # and check what really is once they have (`_make_room`)
        return plan_offload(self.rollout_need, device_free(self.train.device), sizes)

    def _make_room(self, report: SwitchReport, moved: tuple[str, ...]) -> tuple[str, ...]:
        """After torch's cache went back: if the rollout engine still does not fit in what the driver has free
        (blocks torch could not give back), move the state left, largest first; returns the tags moved."""
        need, free = self.rollout_need, device_free(self.train.device, cached=False)
        if need is None or free >= need * MARGIN:
            return ()
        sizes = {t: n for t, n in self.train.state_bytes().items() if t not in moved and t != "params" and n}
        more = plan_offload(need, free, sizes).tags
        report.notes.append(f"offload: {free / GiB:.1f} GiB free once torch's cache went back, the rollout engine "
                            f"needs {need / GiB:.1f} GiB: moved {list(more) or 'nothing more'} as well")
        return more

    def _reserve_host(self) -> int:
        """Allocate (and pin) at start the host buffers of whatever a switch may move: the given tags, or what
        the memory plan moves beside the awake rollout engine (the state as it will be after the first step)."""
        if self.auto:
            sizes = self.train.state_bytes()
            if not sizes or self.rollout_need is None:
                return 0
            # state not allocated yet (an optimizer's moments before the first step) will take memory then
            pending = max(sum(sizes.values()) - torch.cuda.memory_allocated(self.train.device), 0)
            tags = plan_offload(self.rollout_need, device_free(self.train.device) - pending, sizes).tags
        else:
            tags = self.offload_tags + (("params",) if self.offload_params else ())
        return self.train.reserve_host(tags) if tags else 0

    def to_rollout(self) -> SwitchReport:
        """Make the rollout engine serve the train engine's current weights."""
        if self.mode == "rollout":
            raise ModeError("the actor is already in rollout mode")
        gdist.heartbeat()
        timer = PhaseTimer(self.train.device, "to_rollout")
        if self.on_gpu and self._train_peak is None and self.reports:
            self._train_peak = max(torch.cuda.max_memory_allocated(self.train.device) - self._train_base, 0)
        before, after = self._plan_tags(timer.report)
        if self.offload_params:
            after = ("params",)
        self._offloaded_bytes = 0
        if before:
            with timer.phase("offload") as ph:
                ph.bytes = self._offloaded_bytes = self._offload(before)
        if self.on_gpu and not self.rollout_awake:
            # what training freed (offloaded state, activations) sits in torch's cache, which an engine with an
            # allocator of its own cannot use: give it back to the driver before the rollout engine maps memory
            with timer.phase("release_cache") as ph:
                ph.bytes = release_cached(self.train.device)
            more = self._make_room(timer.report, before) if self.auto else ()
            if more:
                with timer.phase("offload_more") as ph:
                    ph.bytes = self._offload(more)
                    self._offloaded_bytes += ph.bytes
                    ph.bytes += release_cached(self.train.device)
                before += more
        self._offloaded = before + after
        if not self.plan.share and not self.rollout_awake:
            with timer.phase("wake_weights"):
                self.rollout.wake(["weights"])
        self.resharder.sync(self.plan, self.train, self.rollout, timer)
        if after:
            with timer.phase("offload_params") as ph:
                ph.bytes = self._offload(after)
                self._offloaded_bytes += ph.bytes
        if not self.rollout_awake:
            if self.on_gpu:
                # what the sync staged on the device and freed (a resharder's loaded file, a gathered bucket)
                # and the params just offloaded sit in torch's cache too: back to the driver before the KV cache
                # maps memory
                with timer.phase("release_cache_after_sync") as ph:
                    ph.bytes = release_cached(self.train.device)
            with timer.phase("wake_kv_cache"):
                self.rollout.wake(["kv_cache"])
        with timer.phase("reset_cache"):
            self.rollout.reset_cache()
        self.mode = "rollout"
        self.reports.append(timer.report)
        return timer.report

    def _offload(self, tags) -> int:
        """Offload the trainer's `tags`; a rollout engine holding its parameters lets go of them first."""
        if "params" in tags:
            self.rollout.release_sources()  # else the memory the offload frees stays mapped by the engine
        return self.train.offload(tags)

    def to_train(self) -> SwitchReport:
        """Release the rollout engine's memory and bring the training state back."""
        if self.mode == "train":
            raise ModeError("the actor is already in train mode")
        gdist.heartbeat()
        timer = PhaseTimer(self.train.device, "to_train")
        tags = tuple(self._offloaded)
        self.rollout_awake = self._keep_rollout_awake(timer.report)
        if not self.rollout_awake:
            with timer.phase("sleep"):
                self.rollout.sleep(["kv_cache", "weights"])
        if tags:
            with timer.phase("onload") as ph:
                ph.bytes = self.train.onload(tags)
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.train.device)
            self._train_base = torch.cuda.memory_allocated(self.train.device)
            self._train_peak = None  # measured again at the next switch to rollout
        self.mode = "train"
        self.reports.append(timer.report)
        return timer.report

    def _keep_rollout_awake(self, report: SwitchReport) -> bool:
        """Whether training fits beside the awake rollout engine: the state it brings back plus what the
        last training phase took beyond its state. Unknown (the first step, a CPU, given tags): it sleeps.
        A trainer that sizes its micro-batches by the memory free (`TrainEngine.memory_bound`) would only take
        smaller ones beside the engine, trading a sleep and a wake (tens of ms) for a slower train phase: it
        sleeps."""
        if not (self.auto and self.on_gpu) or self._train_peak is None or self.offload_params:
            return False
        bound = bool(getattr(self.train, "memory_bound", False))
        # the last train phase ran beside the engine awake (`rollout_awake`) or asleep; squeezed once, it sleeps on
        self._squeezed = self._squeezed or (self.rollout_awake and bound)
        if bound or self._squeezed:
            report.notes.append("rollout engine sleeps: the trainer's micro-batches are sized by free memory")
            awake = False
        else:
            need, free = self._offloaded_bytes + self._train_peak, device_free(self.train.device)
            awake = free >= need * MARGIN
            report.notes.append(f"rollout engine {'stays awake' if awake else 'sleeps'}: training needs "
                                f"{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return gdist.all_ranks(awake)  # every rank's engine the same way, whatever each rank's memory says

    def set_mode(self, mode: str) -> SwitchReport | None:
        """Switch to `mode` ("train" or "rollout"); nothing happens if already there."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == self.mode:
            return None
        return self.to_rollout() if mode == "rollout" else self.to_train()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        self._need("rollout")
        return self.rollout.generate(prompts, sampling)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self._need("train")
        return self.train.train_step(batch, loss_fn)

    def _need(self, mode: str) -> None:
        if self.mode != mode:
            raise ModeError(f"the actor is in {self.mode} mode: call set_mode({mode!r}) first")
