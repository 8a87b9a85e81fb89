"""`HybridActor`: one train engine and one rollout engine sharing the ranks, and the switch between them.

train -> rollout: offload what training does not need, wake the rollout
weights, sync them, optionally offload the training params, wake the KV
cache, reset the prefix cache. rollout -> train: put the rollout engine to
sleep, bring the training state back. Every phase lands in a `SwitchReport`.

When the plan lets the rollout engine serve from the trainer's own tensors
(`ReshardPlan.share`), its weights are not woken (they need no memory of their
own) and the sync hands tensors over instead of copying them.
"""

from __future__ import annotations

from typing import Sequence

from . import dist as gdist
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
        offload: Sequence[str] = ("optimizer", "grads"),
        offload_params: bool = False,
    ) -> None:
        self.train = train
        self.rollout = rollout
        self.resharder = resharder or StreamingResharder()
        self.offload_tags = tuple(offload)
        self.offload_params = offload_params
        self.plan = self.resharder.plan(train, rollout)  # once: a switch does no discovery work
        if self.plan.share and offload_params:
            # the rollout engine would keep the offloaded params alive where they were
            if getattr(self.resharder, "share", None):
                raise ValueError("offload_params=True cannot be combined with a resharder that shares weights "
                                 "(the rollout engine reads the very tensors that would be offloaded)")
            self.plan.share = False
        self.reports: list[SwitchReport] = []
        self.mode = "train"
        self.rollout.sleep(["kv_cache", "weights"])

    def to_rollout(self) -> SwitchReport:
        """Make the rollout engine serve the train engine's current weights."""
        if self.mode == "rollout":
            raise ModeError("the actor is already in rollout mode")
        gdist.heartbeat()
        timer = PhaseTimer(self.train.device, "to_rollout")
        if self.offload_tags:
            with timer.phase("offload") as ph:
                ph.bytes = self.train.offload(self.offload_tags)
        if not self.plan.share:
            with timer.phase("wake_weights"):
                self.rollout.wake(["weights"])
        self.resharder.sync(self.plan, self.train, self.rollout, timer)
        if self.offload_params:
            with timer.phase("offload_params") as ph:
                ph.bytes = self.train.offload(["params"])
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
        with timer.phase("sleep"):
            self.rollout.sleep(["kv_cache", "weights"])
        tags = self.offload_tags + (("params",) if self.offload_params else ())
        if tags:
            with timer.phase("onload") as ph:
                ph.bytes = self.train.onload(tags)
        self.mode = "train"
        self.reports.append(timer.report)
        return timer.report

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
