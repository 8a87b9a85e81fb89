"""Where an FSDP2 parameter's shard lives, in the core's `Placement` terms.

Plain FSDP shards every parameter on dim 0 over all dp ranks: `Placement.of(mesh, {"dp": 0})`.
With tensor parallelism FSDP shards each rank's tensor-parallel slice again, over dp (and sp,
whose ranks hold the same weights: FSDP runs over dp x sp flattened into one group), so a
weight is cut twice; `NestedShard` says in which order (`placement_of` reads it from the
DTensor: `_StridedShard` marks the FSDP cut of a tp slice on the same dimension).
Hybrid sharding (HSDP) splits the dp ranks into `replicate` groups of
consecutive ranks; each group holds one full copy, chunked over its members.
The core's `MeshSpec` has no name for "part of dp", so that layout is the
`HybridShard` placement below: a `Placement` on the same `MeshSpec(dp=N)`
whose `local_box` is the slice `DTensor.to_local()` holds on each rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gearshift.mesh import MeshError, MeshSpec, Placement, Shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass(frozen=True)
class HybridShard(Placement):
    """Chunked on `dim` within each of `replicate` groups of consecutive dp ranks; the groups hold copies."""

    dim: int = 0
    replicate: int = 1

    def __post_init__(self) -> None:
        if self.replicate < 1 or self.mesh.dp % self.replicate:
            raise MeshError(f"replicate={self.replicate} must divide dp={self.mesh.dp}")

    @property
    def shard_size(self) -> int:
        return self.mesh.dp // self.replicate

    def local_box(self, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
        if not 0 <= self.dim < len(shape):
            raise MeshError(f"placement shards dim {self.dim} of a {len(shape)}-d tensor {tuple(shape)}")
        box = [(0, n) for n in shape]
        index = self.mesh.coords(rank)["dp"] % self.shard_size
        n = shape[self.dim]
        chunk = math.ceil(n / self.shard_size) if n else 0
        start = min(index * chunk, n)
        box[self.dim] = (start, min(start + chunk, n))
        return tuple(box)

    def is_replicated(self) -> bool:
        return self.shard_size == 1

    def __str__(self) -> str:
        return f"dp:{self.replicate}x[shard({self.dim}) over {self.shard_size}]"


@dataclass(frozen=True)
class NestedShard(Placement):
    """Cut level by level, outermost first: each level chunks `dim` of the previous level's piece over the ranks
    of its axes taken together (row-major over `RANK_ORDER`, as a flattened device mesh numbers them)."""

    levels: tuple[tuple[tuple[str, ...], int], ...] = ()

    def local_box(self, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
        box = [[0, n] for n in shape]
        coords = self.mesh.coords(rank)
        for axes, dim in self.levels:
            if not 0 <= dim < len(shape):
                raise MeshError(f"placement shards dim {dim} of a {len(shape)}-d tensor {tuple(shape)}")
            parts, index = 1, 0
            for axis in axes:
                size = getattr(self.mesh, axis)
                parts, index = parts * size, index * size + coords[axis]
            lo, hi = box[dim]
            chunk = math.ceil((hi - lo) / parts) if hi > lo else 0
            start = min(lo + index * chunk, hi)
            box[dim] = [start, min(start + chunk, hi)]
        return tuple((lo, hi) for lo, hi in box)

    def is_replicated(self) -> bool:
        return all(getattr(self.mesh, a) == 1 for axes, _ in self.levels for a in axes)

    def __str__(self) -> str:
        return ",".join(f"{'x'.join(axes)}:shard({dim})" for axes, dim in self.levels) or "replicate"


#: the core axes behind each device-mesh dimension name the fsdp backend builds
MESH_AXES = {"dp": ("dp",), "sp": ("sp",), "tp": ("tp",), "dp_sp": ("dp", "sp")}


def nested_placement(param: DTensor, mesh: MeshSpec) -> Placement:
    """The placement of a parameter on a device mesh whose dimensions are named in `MESH_AXES`."""
    names = param.device_mesh.mesh_dim_names or ()
    if any(n not in MESH_AXES for n in names):
        raise MeshError(f"unexpected device mesh dimensions {names} (known: {sorted(MESH_AXES)})")
    outer, inner = [], []
    for name, p in zip(names, param.placements):
        if p.is_shard() or isinstance(p, _StridedShard):
            level = (MESH_AXES[name], p.dim)
            # a strided shard is FSDP's cut of a slice a later mesh dimension made first: it goes inside
            (inner if isinstance(p, _StridedShard) else outer).append(level)
    levels = tuple(outer + inner)
    if all(len(axes) == 1 for axes, _ in levels) and len({a for axes, _ in levels for a in axes}) == len(levels):
        return Placement(mesh, tuple((axes[0], Shard(dim)) for axes, dim in levels if getattr(mesh, axes[0]) > 1)) \
            if levels else Placement.replicated(mesh)
    return NestedShard(mesh, levels=levels)


def placement_of(param: DTensor, mesh: MeshSpec) -> Placement:
    """The placement of an FSDP2 parameter (1-D `dp` mesh, 2-D (`dp_replicate`, `dp_shard`), or a mesh of
    dp / dp x sp and tp)."""
    if set(param.device_mesh.mesh_dim_names or ()) <= set(MESH_AXES) and (
            param.device_mesh.ndim > 1 or param.device_mesh.mesh_dim_names != ("dp",)):
        return nested_placement(param, mesh)
    shards = [p.dim for p in param.placements if p.is_shard()]
    if len(shards) > 1:
        raise MeshError(f"a parameter sharded on several mesh dims ({param.placements}) is not an FSDP layout")
    if param.device_mesh.ndim == 1:
        return Placement.of(mesh, {"dp": shards[0]}) if shards else Placement.replicated(mesh)
    if param.device_mesh.ndim == 2 and not param.placements[0].is_shard():
        return HybridShard(mesh, dim=shards[0] if shards else 0,
                           replicate=param.device_mesh.size(0) if shards else mesh.dp)
    raise MeshError(f"unexpected FSDP layout {param.placements} on {param.device_mesh}")
