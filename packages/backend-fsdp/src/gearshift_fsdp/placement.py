"""Where an FSDP2 parameter's shard lives, in the core's `Placement` terms.

Plain FSDP shards every parameter on dim 0 over all dp ranks: `Placement.of(mesh, {"dp": 0})`.
Hybrid sharding (HSDP) splits the dp ranks into `replicate` groups of
consecutive ranks; each group holds one full copy, chunked over its members.
The core's `MeshSpec` has no name for "part of dp", so that layout is the
`HybridShard` placement below: a `Placement` on the same `MeshSpec(dp=N)`
whose `local_box` is the slice `DTensor.to_local()` holds on each rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gearshift.mesh import MeshError, MeshSpec, Placement
from torch.distributed.tensor import DTensor


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


def placement_of(param: DTensor, mesh: MeshSpec) -> Placement:
    """The placement of an FSDP2 parameter (1-D `dp` mesh, or 2-D (`dp_replicate`, `dp_shard`))."""
    shards = [p.dim for p in param.placements if p.is_shard()]
    if len(shards) > 1:
        raise MeshError(f"a parameter sharded on several mesh dims ({param.placements}) is not an FSDP layout")
    if param.device_mesh.ndim == 1:
        return Placement.of(mesh, {"dp": shards[0]}) if shards else Placement.replicated(mesh)
    if param.device_mesh.ndim == 2 and not param.placements[0].is_shard():
        return HybridShard(mesh, dim=shards[0] if shards else 0,
                           replicate=param.device_mesh.size(0) if shards else mesh.dp)
    raise MeshError(f"unexpected FSDP layout {param.placements} on {param.device_mesh}")
