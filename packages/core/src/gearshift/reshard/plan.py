"""The plan of a switch as plain data: which rank sends which slice of which weight to whom, in which bucket.

A `ReshardPlan` is computed once (`gearshift.reshard.plan_reshard`) and walked
on every switch (`gearshift.reshard.stream_plan`); what each rank does for a
weight is worked out on first use and kept, so a sync repeats none of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..mesh import box_slices
from ..weights import ParamSpec, WeightSpec

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, int], ...]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


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
    """Weights that travel together (rollout names), and the bytes the receivers get for them in all."""

    index: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class RankPiece:
    """One piece of a weight that involves a rank: from `src` to `dst`, where it is cut from and lands."""

    src: int
    dst: int
    src_slices: tuple[slice, ...] | None  # in the source rank's local shard (None: not this rank's to send)
    dst_slices: tuple[slice, ...] | None  # in the receiving rank's tensor (None: not this rank's to receive)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RankView:
    """What one rank does for one weight: the shape it serves, its pieces, and whether it holds it whole."""

    shape: tuple[int, ...] | None  # None: the rank receives none of it (a sender outside the rollout ranks)
    pieces: tuple[RankPiece, ...]
    whole: bool


@dataclass
class ReshardPlan:
    """Every copy a switch makes, worked out once. Weights are named as the rollout engine names them;
    `source_name` gives the train engine's name for each (they differ for a tied head)."""

    src: WeightSpec
    dst: WeightSpec
    buckets: tuple[BucketPlan, ...]
    transfers: dict[str, tuple[Transfer, ...]]
    source_names: dict[str, str]  # rollout name -> train name
    unused: tuple[str, ...] = ()  # train weights the receiver does not take (a value head, say)
    share: bool = False  # the rollout engine serves from the trainer's tensors: a sync copies nothing
    _src: dict[str, ParamSpec] = field(default_factory=dict, repr=False)
    _dst: dict[str, ParamSpec] = field(default_factory=dict, repr=False)
    _views: dict[tuple[int, str], RankView] = field(default_factory=dict, repr=False)
    _whole: dict[tuple[int, int | None], tuple | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._src = self.src.by_name()
        self._dst = self.dst.by_name()

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every global rank the plan involves: the train and rollout ranks (the same ones when colocated)."""
        return tuple(sorted(set(self.src.global_ranks) | set(self.dst.global_ranks)))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def colocated(self) -> bool:
        """Training and rollout run on the same ranks."""
        return set(self.src.global_ranks) == set(self.dst.global_ranks)

    def source(self, name: str) -> ParamSpec:
        """The train side of rollout weight `name`."""
        return self._src[self.source_names[name]]

    def target(self, name: str) -> ParamSpec:
        """The rollout side of weight `name`."""
        return self._dst[name]

    def rank_view(self, rank: int, name: str) -> RankView:
        """What `rank` does for `name`; worked out on first use and kept."""
        key = (rank, name)
        view = self._views.get(key)
        if view is None:
            s, d = self.source(name), self._dst[name]
            i, j = self.src.mesh_rank(rank), self.dst.mesh_rank(rank)
            src_box = s.placement.local_box(s.shape, i) if i is not None else None
            dst_box = d.placement.local_box(d.shape, j) if j is not None else None
            mine = [t for t in self.transfers[name] if rank in (t.src, t.dst)]
            whole = (len(mine) == 1 and mine[0].src == mine[0].dst == rank and src_box is not None
                     and mine[0].box == dst_box == src_box)
            pieces = tuple(RankPiece(t.src, t.dst, box_slices(t.box, src_box) if t.src == rank else None,
                                     box_slices(t.box, dst_box) if t.dst == rank else None, box_shape(t.box))
                           for t in mine)
            view = self._views[key] = RankView(box_shape(dst_box) if dst_box is not None else None, pieces, whole)
        return view

    def whole_bucket(self, rank: int, bucket: BucketPlan) -> tuple[tuple[str, "torch.dtype"], ...] | None:
        """(name, rollout dtype) of each weight of `bucket` when `rank` holds every one of them whole in the
        rollout layout (colocated on one rank, or full replicas on both sides), else None; worked out once."""
        key = (rank, bucket.index)
        if key not in self._whole:
            whole = all(self.rank_view(rank, n).whole for n in bucket.names)
            self._whole[key] = tuple((n, self.target(n).dtype) for n in bucket.names) if whole else None
        return self._whole[key]

    def whole_plan(self, rank: int) -> tuple[tuple[str, "torch.dtype"], ...] | None:
        """`whole_bucket` of every bucket at once: (name, rollout dtype) of every weight when `rank` holds each
        one whole, else None; worked out once."""
        key = (rank, None)
        if key not in self._whole:
            parts = [self.whole_bucket(rank, b) for b in self.buckets]
            self._whole[key] = tuple(w for p in parts for w in p) if parts and None not in parts else None
        return self._whole[key]

    def bytes_received(self, rank: int) -> int:
        """Bytes that land on `rank` in its rollout layout per sync (0 on a rank outside the rollout ranks)."""
        j = self.dst.mesh_rank(rank)
        if j is None:
            return 0
        shapes = self.dst.local_shapes(j)
        return sum(p.dtype.itemsize * numel(shapes[p.name]) for p in self.dst)

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
                    sent[t.dst] = sent.get(t.dst, 0) + itemsize * numel(box_shape(t.box))
                elif t.dst == rank != t.src:
                    received[t.src] = received.get(t.src, 0) + itemsize * numel(box_shape(t.box))
        return sent, received

    def describe(self, rank: int = 0) -> str:
        n_local = sum(1 for ts in self.transfers.values() for t in ts if t.src == t.dst == rank)
        n_send = sum(1 for ts in self.transfers.values() for t in ts if t.src == rank != t.dst)
        n_recv = sum(1 for ts in self.transfers.values() for t in ts if t.dst == rank != t.src)
        pools = "" if self.colocated else (f" (train ranks {list(self.src.global_ranks)}, rollout ranks "
                                           f"{list(self.dst.global_ranks)})")
        return (
            f"{len(self.dst)} weights in {len(self.buckets)} buckets, train {self.src.mesh} -> rollout "
            f"{self.dst.mesh}{pools}; rank {rank}: {n_local} local copies, {n_send} sends, {n_recv} receives"
        )
