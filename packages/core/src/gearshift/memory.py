"""What must leave the device for a switch: offload and sleep only for memory's sake.

On a GPU the train engine's state (params, grads, optimizer) and the rollout
engine's memory (weights unless shared, KV cache) often fit together; then a
switch moves nothing. When they do not, only enough moves, largest first. On
a CPU the train state lives in host memory already: nothing is planned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 2**30
MARGIN = 1.1  # room left beyond what is asked for: allocators round, kernels take workspaces


def device_free(device: torch.device) -> int:
    """Bytes a new allocation can take on `device`: free device memory plus torch's cached, unused blocks."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@dataclass
class OffloadPlan:
    tags: tuple[str, ...]
    note: str


def plan_offload(need: int, free: int, sizes: dict[str, int]) -> OffloadPlan:
    """The train tags to move off the device so that `need` more bytes fit beside what stays, largest first."""
    moved: list[str] = []
    room = free
    for tag in sorted(sizes, key=sizes.get, reverse=True):
        if room >= need * MARGIN:
            break
        if sizes[tag] > 0:
            moved.append(tag)
            room += sizes[tag]
    kept = [t for t in sizes if t not in moved and sizes[t] > 0]
    what = f"{free / GiB:.1f} GiB free, rollout needs {need / GiB:.1f} GiB"
    if not moved:
        return OffloadPlan((), f"kept {kept or 'nothing'} on the device ({what})")
    short = " (still short: the rollout engine may not fit)" if room < need * MARGIN else ""
    return OffloadPlan(tuple(moved), f"moved {moved} to host memory ({what}){short}")
