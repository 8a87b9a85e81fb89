"""Device meshes with named axes, and where a tensor's pieces live on them.

A `MeshSpec` names how many ranks each parallel axis spans (dp, tp, pp, sp).
Ranks are laid out row-major over `RANK_ORDER` (pp outermost, tp innermost),
so tensor-parallel peers are neighbouring ranks, as in Megatron and torchtitan.

A `Placement` says, per axis, whether a tensor is replicated along it or
sharded on one of its dimensions. Shards follow `torch.chunk` (and DTensor's
`Shard`) semantics: chunk size is ceil(n / k), trailing ranks may hold less or
nothing, so a FSDP2 local shard is exactly the slice computed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

AXES = ("dp", "tp", "pp", "sp")
RANK_ORDER = ("pp", "dp", "sp", "tp")  # outermost first


class MeshError(ValueError):
    """A mesh that does not fit the world, or a placement that does not fit a tensor."""


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the named parallel axes; their product is the world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            size = getattr(self, f.name)
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {f.name}={size!r}: sizes are whole numbers >= 1")

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Build from 'dp=4,tp=2' (axes left out are 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            axis, sep, value = part.partition("=")
            axis = axis.strip()
            if not sep or axis not in AXES or not value.strip().isdigit():
                raise MeshError(f"bad mesh {text!r}: write it as 'dp=4,tp=2' with axes from {AXES}")
            sizes[axis] = int(value)
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in RANK_ORDER}

    def validate(self, world_size: int) -> "MeshSpec":
        """Raise a `MeshError` saying what to change unless the mesh covers `world_size` ranks."""
        if self.world_size != world_size:
            raise MeshError(
                f"mesh {self} spans {self.world_size} ranks but the world has {world_size}: "
                f"make dp*tp*pp*sp equal {world_size} (for example {MeshSpec(dp=world_size)})"
            )
        return self

    def coords(self, rank: int) -> dict[str, int]:
        """The index of `rank` along each axis."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside mesh {self} of {self.world_size} ranks")
        coords: dict[str, int] = {}
        for axis in reversed(RANK_ORDER):
            size = getattr(self, axis)
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in RANK_ORDER}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given axis indices (axes left out are 0)."""
        rank = 0
        for axis in RANK_ORDER:
            index = coords.get(axis, 0)
            size = getattr(self, axis)
            if not 0 <= index < size:
                raise MeshError(f"{axis}={index} is outside mesh {self}")
            rank = rank * size + index
        return rank

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (its process group on that axis)."""
        coords = self.coords(rank)
        return [self.rank_of(**{**coords, axis: i}) for i in range(getattr(self, axis))]

    def to_device_mesh(self, device_type: str = "cpu", axes: tuple[str, ...] | None = None):
        """A `torch.distributed.DeviceMesh` with these axis names (size-1 axes dropped unless named)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = axes or tuple(a for a in RANK_ORDER if getattr(self, a) > 1) or ("dp",)
        dropped = [a for a in RANK_ORDER if a not in names and getattr(self, a) > 1]
        if dropped:
            raise MeshError(f"axes {dropped} of {self} have size > 1 and must be in the device mesh")
        names = tuple(a for a in RANK_ORDER if a in names)
        return init_device_mesh(device_type, tuple(getattr(self, a) for a in names), mesh_dim_names=names)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "dp=1"


@dataclass(frozen=True)
class Shard:
    """Split along tensor dimension `dim`."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """A full copy on every rank of the axis."""


REPLICATE = Replicate()


@dataclass(frozen=True)
class Placement:
    """How one tensor lies on a mesh: axis -> Shard(dim) or Replicate (axes left out replicate)."""

    mesh: MeshSpec
    axes: tuple[tuple[str, Shard], ...] = ()

    @classmethod
    def of(cls, mesh: MeshSpec, shards: Mapping[str, int] | None = None) -> "Placement":
        """`Placement.of(mesh, {"dp": 0})`: shard dim 0 over dp, replicate elsewhere."""
        shards = dict(shards or {})
        for axis in shards:
            if axis not in AXES:
                raise MeshError(f"unknown mesh axis {axis!r}; axes are {AXES}")
        ordered = tuple((a, Shard(shards[a])) for a in RANK_ORDER if a in shards and getattr(mesh, a) > 1)
        return cls(mesh, ordered)

    @classmethod
    def replicated(cls, mesh: MeshSpec) -> "Placement":
        return cls(mesh)

    def local_box(self, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
        """The [start, stop) range per dimension of the slice `rank` holds; empty ranges allowed."""
        box = [[0, n] for n in shape]
        coords = self.mesh.coords(rank)
        for axis, shard in self.axes:  # outer axes first: nested chunking
            if not 0 <= shard.dim < len(shape):
                raise MeshError(f"placement shards dim {shard.dim} of a {len(shape)}-d tensor {tuple(shape)}")
            lo, hi = box[shard.dim]
            parts = getattr(self.mesh, axis)
            chunk = math.ceil((hi - lo) / parts) if hi > lo else 0
            start = min(lo + coords[axis] * chunk, hi)
            box[shard.dim] = [start, min(start + chunk, hi)]
        return tuple((lo, hi) for lo, hi in box)

    def local_shape(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.local_box(shape, rank))

    def is_replicated(self) -> bool:
        return not self.axes

    def __str__(self) -> str:
        return ",".join(f"{a}:shard({s.dim})" for a, s in self.axes) or "replicate"


def box_slices(box: tuple[tuple[int, int], ...], origin: tuple[tuple[int, int], ...] | None = None) -> tuple[slice, ...]:
    """Slices selecting `box`, relative to the start of `origin` (a local shard) when given."""
    if origin is None:
        return tuple(slice(lo, hi) for lo, hi in box)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def intersect(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]):
    """The common box of `a` and `b`, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out
