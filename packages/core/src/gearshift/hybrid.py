"""`HybridActor`: one train engine and one rollout engine sharing the ranks, and the switch between them.

train -> rollout: offload what training does not need, wake the rollout
weights, sync them, optionally offload the training params, wake the KV
cache, reset the prefix cache. rollout -> train: put the rollout engine to
sleep, bring the training state back. Every phase lands in a `SwitchReport`.

Memory decides what moves (`offload="auto"`, the default; memory.py): on a
GPU, train state leaves the device only when the rollout engine's memory does
not fit beside it, largest first, and the rollout engine is put to sleep only
when training does not fit beside it (measured on the step before); host
buffers for what will move are allocated at start. Given tags, `offload`
always moves exactly those. On a CPU the train state is in host memory
already, and the rollout engine always sleeps.

When the plan lets the rollout engine serve from the trainer's own tensors
(`ReshardPlan.share`), its weights are not woken (they need no memory of their
own) and the sync hands tensors over instead of copying them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import dist as gdist
from .memory import MARGIN, GiB, device_free, plan_offload
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
            if getattr(self.resharder, "share", None):
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
        self._train_peak: int | None = None  # device bytes the last training phase took beyond its state
        if self.auto and self.on_gpu:
            self._reserve_host()

    def _plan_tags(self, report: SwitchReport) -> tuple[str, ...]:
        """What to offload on the way to rollout: the given tags, or what memory asks for."""
        if not self.auto:
            return self.offload_tags
        if not self.on_gpu:
            report.notes.append("offload: none (the train state is in host memory already)")
            return ()
        sizes = getattr(self.train, "state_bytes", dict)()
        if self.rollout_need is None or not sizes:
            report.notes.append("offload: optimizer, grads (the engines report no sizes to plan with)")
            return ("optimizer", "grads")
        if self.rollout_awake:
            report.notes.append("offload: none (the rollout engine stayed awake beside training)")
            return ()
        plan = plan_offload(self.rollout_need, device_free(self.train.device), sizes)
        report.notes.append(f"offload: {plan.note}")
        return plan.tags

    def _reserve_host(self) -> None:
        """Allocate (and pin) at start the host buffers the first switch would otherwise allocate."""
        sizes = getattr(self.train, "state_bytes", dict)()
        if self.rollout_need is None or not sizes or not hasattr(self.train, "reserve_host"):
            return
        plan = plan_offload(self.rollout_need, device_free(self.train.device), sizes)
        if plan.tags:
            self.train.reserve_host(plan.tags)

    def to_rollout(self) -> SwitchReport:
        """Make the rollout engine serve the train engine's current weights."""
        if self.mode == "rollout":
            raise ModeError("the actor is already in rollout mode")
        gdist.heartbeat()
        timer = PhaseTimer(self.train.device, "to_rollout")
        if self.on_gpu and self._train_peak is None and self.reports:
            self._train_peak = max(torch.cuda.max_memory_allocated(self.train.device) - self._train_base, 0)
        tags = self._plan_tags(timer.report)
        self._offloaded, self._offloaded_bytes = tags, 0
        if tags:
            with timer.phase("offload") as ph:
                ph.bytes = self._offloaded_bytes = self.train.offload(tags)
        if not self.plan.share and not self.rollout_awake:
            with timer.phase("wake_weights"):
                self.rollout.wake(["weights"])
        self.resharder.sync(self.plan, self.train, self.rollout, timer)
        if self.offload_params:
            with timer.phase("offload_params") as ph:
                ph.bytes = self.train.offload(["params"])
        if not self.rollout_awake:
            with timer.phase("wake_kv_cache"):
                self.rollout.wake(["kv_cache"])
        with timer.phase("reset_cache"):
            self.rollout.reset_cache()
        self.mode = "rollout"
        self.reports.append(timer.report)
        return timer.report

    def to_train(self) -> SwitchReport:
        """Release the rollout engine's memory and bring the training state back."""
        if self.mode == "train":
            raise ModeError("the actor is already in train mode")
        gdist.heartbeat()
        timer = PhaseTimer(self.train.device, "to_train")
        tags = tuple(getattr(self, "_offloaded", self.offload_tags)) + (("params",) if self.offload_params else ())
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
        last training phase took beyond its state. Unknown (the first step, a CPU, given tags): it sleeps."""
        if not (self.auto and self.on_gpu) or self._train_peak is None or self.offload_params:
            return False
        need, free = self._offloaded_bytes + self._train_peak, device_free(self.train.device)
        awake = free >= need * MARGIN
        report.notes.append(f"rollout engine {'stays awake' if awake else 'sleeps'}: training needs "
                            f"{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return awake

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
