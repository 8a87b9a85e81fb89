"""Gradient clipping over parameters that lie on different device meshes.

With tensor parallelism some parameters are DTensors on the (dp, tp) mesh and the
rest (norms, embeddings) on dp alone; DTensor's kernels take one mesh at a time, so
the norm is summed from the local shards in one all-reduce, and clipping scales
each mesh's gradients on their own.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def by_mesh(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by device mesh (plain tensors form a group of their own), in first-seen order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of every gradient together, over every shard; a plain tensor, the same on every rank.

    One all-reduce of every rank's sum of squares, each weighed by how many ranks hold the same
    shard (the ranks of its mesh's unsharded dimensions, and those outside its mesh).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    squares = []
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        copies = world
        if hasattr(g, "placements"):
            for size, p in zip(g.device_mesh.shape, g.placements):
                if p.is_shard() or type(p).__name__ == "_StridedShard":
                    copies //= size
        squares.append(local.detach().double().pow(2).sum() / copies)  # in float64: many terms, little loss
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if world > 1:
        from gearshift import dist as gdist

        total = total.to(gdist.collective_device())
        dist.all_reduce(total)
    return total.sqrt().float()


def clip_by_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
    """Scale the gradients of `params` so their total norm is at most `max_norm`; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in params])
    if max_norm is not None:
        for group in by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return float(norm)


def sum_partial_grads(params: Sequence[torch.Tensor], group) -> None:
    """Add up over `group` the gradients each of its ranks computed from its slice of the heads."""
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=group)
