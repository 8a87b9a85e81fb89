"""Resharders: what a switch calls to make the rollout engine's weights equal the train engine's.

`stream` runs the plan bucket by bucket straight into the rollout engine (or
hands it the trainer's own tensors when the plan allows); `naive` is the file
round trip of systems without a resharder, kept as the baseline benchmarks
compare with; `adapter` sends a LoRA trainer's adapter alone to a rollout
engine that serves adapters on top of the base weights it already holds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from .. import dist as gdist
from ..mesh import box_slices
from ..profiler import PhaseTimer, SwitchReport
from ..weights import WeightBucket, WeightError
from .export import export_weights
from .plan import ReshardPlan
from .planner import DEFAULT_BUCKET_BYTES, plan_reshard, share_refusal
from .stream import stream_plan

if TYPE_CHECKING:
    from ..rollout import RolloutEngine
    from ..train import TrainEngine


class Resharder(ABC):
    """Moves weights from a train engine into a rollout engine on every switch."""

    #: True: every sync hands the rollout engine the trainer's own tensors (or refuses); None: when it can;
    #: False: never. A resharder that always copies leaves it None: its plans never share.
    share: bool | None = None

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if int(bucket_bytes) < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.bucket_bytes = int(bucket_bytes)

    def plan(self, train: "TrainEngine", rollout: "RolloutEngine") -> ReshardPlan:
        """Work out every copy once, at start-up; raises `WeightError` on mismatched weights."""
        return plan_reshard(train.weight_spec(), rollout.weight_spec(), self.bucket_bytes)

    @abstractmethod
    def sync(self, plan: ReshardPlan, train: "TrainEngine", rollout: "RolloutEngine",
             timer: PhaseTimer | None = None) -> SwitchReport:
        """Make the rollout engine's weights equal the train engine's; time each phase into the report."""


class _TimedIterator:
    """Wraps a bucket stream, adding the time spent producing buckets and their bytes."""

    def __init__(self, it: Iterable[WeightBucket]) -> None:
        self._it = iter(it)
        self.seconds = 0.0
        self.bytes = 0

    def __iter__(self):
        return self

    def __next__(self) -> WeightBucket:
        t0 = time.perf_counter()
        try:
            bucket = next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0
        self.bytes += bucket.nbytes
        return bucket


class StreamingResharder(Resharder):
    """Runs the plan bucket by bucket straight into the rollout engine: no disk, one bucket extra.

    `share`: None (default) hands the rollout engine the trainer's own tensors whenever the
    layouts, dtypes and devices already agree and both engines allow it (`share_weights`), and
    copies otherwise; True insists on sharing (a plan that cannot share raises `WeightError`
    saying why); False always copies (`update_weights`).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, share: bool | None = None) -> None:
        super().__init__(bucket_bytes)
        if share not in (None, True, False):
            raise ValueError(f"share must be None (when possible), True or False, got {share!r}")
        self.share = share

    def plan(self, train, rollout) -> ReshardPlan:
        plan = super().plan(train, rollout)
        if self.share is not False:
            why = self.share_refusal(plan, train, rollout)
            if why is not None and self.share:
                raise WeightError(f"cannot share the trainer's weights with the rollout engine: {why}")
            plan.share = why is None
        return plan

    @staticmethod
    def share_refusal(plan: ReshardPlan, train: "TrainEngine", rollout: "RolloutEngine") -> str | None:
        """Why this pair cannot share weights under `plan` (None: it can)."""
        if not rollout.can_share_weights:
            return f"the rollout engine {type(rollout).__name__} cannot serve from another engine's tensors"
        if not train.can_lend_weights:
            return f"the train engine {type(train).__name__} holds its weights whole only while exporting them"
        if torch.device(train.device) != torch.device(rollout.device):
            return f"training runs on {train.device} and rollout on {rollout.device}"
        return share_refusal(plan)

    def sync(self, plan, train, rollout, timer=None) -> SwitchReport:
        timer = timer or PhaseTimer(train.device, "to_rollout")
        stream = _TimedIterator(stream_plan(plan, train.local_weights, cast=not rollout.casts_on_load,
                                            materialized=train.materialized, lent=lends(train)))
        with timer.phase("sync") as total:
            if plan.share:
                rollout.share_weights(stream)
            else:
                rollout.update_weights(stream)
        timer.report.phases.remove(total)
        timer.add("export", stream.seconds)
        if plan.share:  # nothing lands anywhere: the rollout engine now reads the trainer's tensors
            timer.add("share", max(total.seconds - stream.seconds, 0.0), 0)
        else:  # the bytes moved are those that land in the rollout engine, in its dtype: counted once, on load
            timer.add("load", max(total.seconds - stream.seconds, 0.0), plan.bytes_received(gdist.rank()))
        return timer.report


def lends(train: "TrainEngine") -> bool:
    """Whether `train.local_weights` returns the engine's own tensors, which keep their place between syncs."""
    return bool(train.can_lend_weights) and not train.lora_rank


class NaiveResharder(Resharder):
    """The file round trip: gather, write a safetensors checkpoint, reload it into the rollout engine."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, directory: str | None = None) -> None:
        super().__init__(bucket_bytes)
        self.directory = directory

    def sync(self, plan, train, rollout, timer=None) -> SwitchReport:
        from safetensors.torch import load_file, save_file

        timer = timer or PhaseTimer(train.device, "to_rollout")
        rank = gdist.rank()
        root = Path(self.directory or tempfile.gettempdir())
        path = root / "gearshift-naive-sync" / "model.safetensors"
        with timer.phase("save") as ph:
            state: dict[str, torch.Tensor] = {}
            for bucket in export_weights(train, plan.dst.replicated(), self.bucket_bytes):
                if rank == 0:
                    state.update((k, v.detach().to("cpu", copy=True).contiguous()) for k, v in bucket.items())
            if rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file(state, str(path))
                ph.bytes = os.path.getsize(path)
            del state
            gdist.barrier()
        with timer.phase("load") as ph:
            loaded = load_file(str(path), device=str(train.device) if train.device.type != "cpu" else "cpu")
            mine = {}
            for p in plan.dst:
                box = p.placement.local_box(p.shape, rank)
                mine[p.name] = loaded[p.name][box_slices(box)]
            ph.bytes = sum(t.numel() * t.element_size() for t in mine.values())
            rollout.update_weights([WeightBucket(mine)])
            del loaded, mine
            gdist.barrier()
            if rank == 0:
                shutil.rmtree(path.parent, ignore_errors=True)
        return timer.report


class AdapterResharder(Resharder):
    """A LoRA trainer's adapter alone, whole on every rank, into a rollout engine that serves adapters.

    The rollout engine keeps the base weights it was built from (the trainer's frozen base) and
    applies the adapter on top (`RolloutEngine.load_adapter`): a sync moves r x (in + out)
    numbers per adapted weight instead of every weight, and nothing is merged. The plan is still
    worked out from both weight specs, so a pair whose base models differ fails at start.
    """

    def plan(self, train, rollout) -> ReshardPlan:
        why = self.refusal(train, rollout)
        if why is not None:
            raise WeightError(f"cannot sync the adapter alone: {why}")
        plan = super().plan(train, rollout)
        plan.share = False
        return plan

    @staticmethod
    def refusal(train: "TrainEngine", rollout: "RolloutEngine") -> str | None:
        """Why this pair cannot sync by adapter (None: it can)."""
        if not rollout.can_load_adapters:
            return f"the rollout engine {type(rollout).__name__} cannot serve LoRA adapters"
        rank = train.lora_rank
        if not rank:
            return f"the train engine {type(train).__name__} trains no LoRA adapter"
        if rank > rollout.args.max_lora_rank:
            return (f"the trainer's adapters have rank {rank}, above the rollout engine's max_lora_rank="
                    f"{rollout.args.max_lora_rank}")
        return None

    def sync(self, plan, train, rollout, timer=None) -> SwitchReport:
        timer = timer or PhaseTimer(train.device, "to_rollout")
        with timer.phase("export"):
            adapter = train.export_adapter()
            if adapter is None:
                raise WeightError(f"{type(train).__name__} has no adapter to export")
        with timer.phase("load") as ph:
            ph.bytes = rollout.load_adapter(adapter)
        return timer.report
