"""Moving weights from the training layout to the rollout layout.

`plan_reshard` works out once, from the two engines' `WeightSpec`s, which
slice of which weight each rank sends to which rank and where the bucket
boundaries fall. `stream_plan` then walks that list on every switch: local
pieces are views or copies, remote ones point-to-point sends, one bucket at a
time, so the extra memory is one bucket.

When every rank already holds each weight whole, in the dtype and on the
device the rollout engine wants (one process, or data parallel on both sides,
fp32 on a CPU), there is nothing to move: a rollout engine that can serve from
the trainer's own tensors (`RolloutEngine.share_weights`) is handed them, and a
sync costs a few pointer swaps. `StreamingResharder(share=None)` does that
whenever the plan allows it; `share=False` always copies.

Two resharders ship with the core: `stream` (the above) and `naive` (what a
system without a resharder does: the trainer writes a full safetensors
checkpoint and the rollout engine reloads it from that path); benchmarks
compare against the latter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from . import dist as gdist
from .mesh import box_slices, intersect
from .profiler import PhaseTimer, SwitchReport
from .weights import ParamSpec, WeightBucket, WeightError, WeightSpec

if TYPE_CHECKING:
    from .rollout import RolloutEngine
    from .train import TrainEngine

DEFAULT_BUCKET_BYTES = 128 * 2**20

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Transfer:
    """`src` sends the region `box` (global indices) of weight `name` to `dst`; a tag orders it."""

    name: str
    src: int
    dst: int
    box: Box
    tag: int


@dataclass(frozen=True)
class BucketPlan:
    """Weights that travel together, and the bytes the receivers get for them in all."""

    index: int
    names: tuple[str, ...]
    nbytes: int


@dataclass
class ReshardPlan:
    """Every copy a switch makes, worked out once."""

    src: WeightSpec
    dst: WeightSpec
    buckets: tuple[BucketPlan, ...]
    transfers: dict[str, tuple[Transfer, ...]]
    unused: tuple[str, ...] = ()  # source weights the receiver does not take (a value head, say)
    share: bool = False  # the rollout engine serves from the trainer's tensors: a sync copies nothing
    _src: dict[str, ParamSpec] = field(default_factory=dict, repr=False)
    _dst: dict[str, ParamSpec] = field(default_factory=dict, repr=False)
    _views: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._src = self.src.by_name()
        self._dst = self.dst.by_name()

    @property
    def world_size(self) -> int:
        return self.dst.mesh.world_size

    def rank_view(self, rank: int, name: str) -> tuple[tuple[int, ...], list[tuple], bool]:
        """What `rank` does for `name`: the shape it serves, its pieces (source rank, destination rank,
        slices of the source shard, slices of the served tensor, shape), and whether it already holds
        the tensor it serves whole. Worked out on first use and kept, so a sync repeats none of it."""
        key = (rank, name)
        view = self._views.get(key)
        if view is None:
            s, d = self._src[name], self._dst[name]
            src_box, dst_box = s.placement.local_box(s.shape, rank), d.placement.local_box(d.shape, rank)
            mine = [t for t in self.transfers[name] if rank in (t.src, t.dst)]
            whole = len(mine) == 1 and mine[0].src == mine[0].dst == rank and mine[0].box == dst_box == src_box
            pieces = [(t.src, t.dst, box_slices(t.box, src_box) if t.src == rank else None,
                       box_slices(t.box, dst_box) if t.dst == rank else None, _box_shape(t.box)) for t in mine]
            view = self._views[key] = (_box_shape(dst_box), pieces, whole)
        return view

    def bytes_received(self, rank: int) -> int:
        """Bytes that land on `rank` in its rollout layout per sync."""
        return sum(p.dtype.itemsize * _numel(_box_shape(p.placement.local_box(p.shape, rank))) for p in self.dst)

    def bytes_sent_remote(self, rank: int) -> int:
        """Bytes `rank` sends to other ranks per sync."""
        return sum(self.peer_bytes(rank)[0].values())

    def peer_bytes(self, rank: int) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes `rank` sends to each other rank per sync, and bytes it receives from each (rollout dtypes)."""
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for name, transfers in self.transfers.items():
            itemsize = self._dst[name].dtype.itemsize
            for t in transfers:
                if t.src == rank != t.dst:
                    sent[t.dst] = sent.get(t.dst, 0) + itemsize * _numel(_box_shape(t.box))
                elif t.dst == rank != t.src:
                    received[t.src] = received.get(t.src, 0) + itemsize * _numel(_box_shape(t.box))
        return sent, received

    def describe(self, rank: int = 0) -> str:
        n_local = sum(1 for ts in self.transfers.values() for t in ts if t.src == t.dst == rank)
        n_send = sum(1 for ts in self.transfers.values() for t in ts if t.src == rank != t.dst)
        n_recv = sum(1 for ts in self.transfers.values() for t in ts if t.dst == rank != t.src)
        return (
            f"{len(self.dst)} weights in {len(self.buckets)} buckets, train {self.src.mesh} -> rollout "
            f"{self.dst.mesh}; rank {rank}: {n_local} local copies, {n_send} sends, {n_recv} receives"
        )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def plan_reshard(src: WeightSpec, dst: WeightSpec, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReshardPlan:
    """Plan moving `src` (train layout) into `dst` (rollout layout) over the same ranks."""
    if src.mesh.world_size != dst.mesh.world_size:
        raise WeightError(
            f"train mesh {src.mesh} spans {src.mesh.world_size} ranks but rollout mesh {dst.mesh} spans "
            f"{dst.mesh.world_size}: both must cover the same ranks"
        )
    have = src.by_name()
    missing = [p.name for p in dst if p.name not in have]
    if missing:
        raise WeightError(
            f"the rollout engine wants {len(missing)} weights the train engine does not have, "
            f"first {missing[:3]}: are both engines loaded from the same model?"
        )
    for p in dst:
        if tuple(have[p.name].shape) != tuple(p.shape):
            raise WeightError(f"weight {p.name!r}: train shape {have[p.name].shape}, rollout shape {p.shape}")
    world = dst.mesh.world_size
    transfers: dict[str, tuple[Transfer, ...]] = {}
    tag = 0
    for p in dst:
        s = have[p.name]
        holders: dict[Box, list[int]] = {}
        for r in range(world):
            box = s.placement.local_box(s.shape, r)
            if all(hi > lo for lo, hi in box):
                holders.setdefault(box, []).append(r)
        out: list[Transfer] = []
        for d in range(world):
            want = p.placement.local_box(p.shape, d)
            for box, ranks in holders.items():
                piece = intersect(box, want)
                if piece is None:
                    continue
                source = d if d in ranks else ranks[d % len(ranks)]
                out.append(Transfer(p.name, source, d, piece, tag))
                tag += 1
        transfers[p.name] = tuple(out)
    buckets: list[BucketPlan] = []
    names: list[str] = []
    size = 0
    for p in dst:
        if names and size + p.nbytes > bucket_bytes:
            buckets.append(BucketPlan(len(buckets), tuple(names), size))
            names, size = [], 0
        names.append(p.name)
        size += p.nbytes
    if names:
        buckets.append(BucketPlan(len(buckets), tuple(names), size))
    wanted = {p.name for p in dst}
    unused = tuple(p.name for p in src if p.name not in wanted)
    return ReshardPlan(src, dst, tuple(buckets), transfers, unused)


def share_refusal(plan: ReshardPlan) -> str | None:
    """Why the rollout engine cannot serve from the trainer's own tensors under this plan (None: it can).

    Sharing needs every rank to hold every weight whole in its rollout layout and dtype already,
    so that the stream passes the trainer's tensors on untouched and no rank talks to another.
    """
    for name, transfers in plan.transfers.items():
        s, d = plan._src[name], plan._dst[name]
        if s.dtype != d.dtype:
            return f"{name!r} is {s.dtype} in training but the rollout engine wants {d.dtype}"
        for r in range(plan.world_size):
            if not plan.rank_view(r, name)[2]:
                t = next((t for t in transfers if t.src != t.dst), None)
                if t is not None:
                    return f"{name!r} travels from rank {t.src} to rank {t.dst} (the layouts differ)"
                return f"rank {r} holds another slice of {name!r} in training than the rollout engine wants"
    return None


def stream_plan(
    plan: ReshardPlan,
    local_weights: Callable[[list[str]], Mapping[str, torch.Tensor]],
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
    cast: bool = True,
) -> Iterator[WeightBucket]:
    """Yield this rank's weights in the rollout layout, bucket by bucket, running the plan's copies.

    `local_weights(names)` returns this rank's shards in the train layout (views are fine).
    A piece that is already whole and in the right dtype is passed on as is: no copy.
    `cast=False` passes whole local pieces on in the trainer's dtype too, for a receiver that
    casts as it copies (`RolloutEngine.casts_on_load`): one pass over the bytes instead of two.
    Pieces bound for another rank travel packed: one message per peer (and dtype) per bucket,
    so a switch sends a few large messages rather than one per weight slice.
    """
    rank = gdist.rank() if rank is None else rank
    dtypes = sorted({str(p.dtype) for p in plan.dst})
    # one tag per bucket and dtype: both ends work it out from the plan alone
    def tag(bucket: BucketPlan, dtype: torch.dtype) -> int:
        return bucket.index * len(dtypes) + dtypes.index(str(dtype))

    for bucket in plan.buckets:
        local = local_weights(list(bucket.names))
        out: dict[str, torch.Tensor] = {}
        # the tensors this rank assembles are views into one buffer per dtype: one allocation, not one per weight
        sizes: dict[torch.dtype, int] = {}
        for name in bucket.names:
            shape, _, whole = plan.rank_view(rank, name)
            if not whole:
                sizes[plan._dst[name].dtype] = sizes.get(plan._dst[name].dtype, 0) + _numel(shape)
        device = local[bucket.names[0]].device if bucket.names else None
        arena = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        used = dict.fromkeys(arena, 0)
        sends: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        recvs: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]]] = {}
        for name in bucket.names:
            d = plan._dst[name]
            shape, pieces, whole = plan.rank_view(rank, name)
            if whole:
                t = local[name]
                out[name] = t if t.dtype == d.dtype or not cast else t.to(d.dtype)
                continue
            start, n = used[d.dtype], _numel(shape)
            out[name] = arena[d.dtype][start:start + n].view(shape)
            used[d.dtype] = start + n
            for src, dst, src_slices, dst_slices, piece_shape in pieces:
                if src == rank:
                    piece = local[name][src_slices]
                    if dst == rank:
                        out[name][dst_slices].copy_(piece)
                    else:
                        sends.setdefault((dst, d.dtype), []).append(piece.reshape(-1))
                else:
                    recvs.setdefault((src, d.dtype), []).append((out[name], dst_slices, piece_shape))
        if sends or recvs:
            ops: list[dist.P2POp] = []
            for (peer, dtype), flats in sends.items():  # packed and cast in one pass
                flat = torch.empty(sum(f.numel() for f in flats), dtype=dtype, device=device)
                torch.cat(flats, out=flat)
                ops.append(dist.P2POp(dist.isend, flat, peer, group, tag(bucket, dtype)))
            landing = []
            for (peer, dtype), places in recvs.items():
                flat = torch.empty(sum(_numel(shape) for _, _, shape in places), dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, flat, peer, group, tag(bucket, dtype)))
                landing.append((flat, places))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for flat, places in landing:
                parts = flat.split([_numel(shape) for _, _, shape in places])
                for (buf, where, shape), part in zip(places, parts):
                    buf[where].copy_(part.view(shape))
            # else these hold this bucket's buffers while the next one is built
            ops = landing = sends = recvs = flat = flats = work = buf = places = parts = part = None
        arena = None  # the bucket's tensors keep what they view alive; the consumer decides when it goes
        yield WeightBucket(out, bucket.index)


class Resharder(ABC):
    """Moves weights from a train engine into a rollout engine on every switch."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(options)}")
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
    layouts, dtypes and devices already agree and the engine can serve from them
    (`share_weights`), and copies otherwise; True insists on sharing (a plan that cannot
    share raises `WeightError` saying why); False always copies (`update_weights`).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, share: bool | None = None, **options) -> None:
        super().__init__(bucket_bytes, **options)
        if share not in (None, True, False):
            raise TypeError(f"share must be None (when possible), True or False, got {share!r}")
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
        if torch.device(train.device) != torch.device(rollout.device):
            return f"training runs on {train.device} and rollout on {rollout.device}"
        return share_refusal(plan)

    def sync(self, plan, train, rollout, timer=None) -> SwitchReport:
        timer = timer or PhaseTimer(train.device, "to_rollout")
        stream = _TimedIterator(stream_plan(plan, train.local_weights, cast=not rollout.casts_on_load))
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


class NaiveResharder(Resharder):
    """The file round trip: gather, write a safetensors checkpoint, reload it into the rollout engine."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, directory: str | None = None, **options) -> None:
        super().__init__(bucket_bytes, **options)
        self.directory = directory

    def sync(self, plan, train, rollout, timer=None) -> SwitchReport:
        from safetensors.torch import load_file, save_file

        timer = timer or PhaseTimer(train.device, "to_rollout")
        rank = gdist.rank()
        root = Path(self.directory or tempfile.gettempdir())
        path = root / "gearshift-naive-sync" / "model.safetensors"
        with timer.phase("save") as ph:
            state: dict[str, torch.Tensor] = {}
            for bucket in train.export_weights(plan.dst.replicated(), self.bucket_bytes):
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
