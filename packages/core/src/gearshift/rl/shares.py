"""Which prompts each rank rolls out, and which samples it trains on, when the two meshes cut the ranks differently.

A step's prompts are dealt out by data-parallel index: the ranks of one rollout
replica (its tp peers) generate for the same prompts with the same seed, the
ranks of one train replica (tp and sp peers) train on the same samples. When
both meshes give every rank the same dp index (the default: dp over every
rank), a rank trains on what it rolled out. Otherwise the replicas' samples
are gathered on every rank and dealt out again by train dp index, each prompt
with all of its samples (a GRPO group stays on one rank).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .. import dist as gdist
from ..mesh import MeshSpec
from ..rollout import Rollout


class Shares:
    """This rank's share of a step's prompts under the rollout mesh, and of its samples under the train mesh."""

    def __init__(self, rollout_mesh: MeshSpec, train_mesh: MeshSpec, rank: int | None = None) -> None:
        self.rank = gdist.rank() if rank is None else rank
        self.rollout_mesh, self.train_mesh = rollout_mesh, train_mesh
        self.rollout_dp = rollout_mesh.coords(self.rank)["dp"]
        self.train_dp = train_mesh.coords(self.rank)["dp"]
        world = rollout_mesh.world_size
        self.same = rollout_mesh.dp == train_mesh.dp and all(
            rollout_mesh.coords(r)["dp"] == train_mesh.coords(r)["dp"] for r in range(world))

    def rollout_rows(self, rows: Sequence) -> list:
        """The prompts this rank's rollout replica generates for."""
        return list(rows[self.rollout_dp::self.rollout_mesh.dp])

    def to_train(self, rows: list, rollouts: list[Rollout]) -> tuple[list, list[Rollout]]:
        """The (prompt rows, samples) this rank trains on; a collective unless both meshes deal alike."""
        if self.same:
            return rows, rollouts
        # one copy of each rollout replica's samples: its first rank's (its tp peers hold the same)
        leader = self.rollout_mesh.coords(self.rank)["tp"] == 0
        mine = (self.rollout_dp, rows, rollouts) if leader else None
        everyone = gdist.all_gather_object(mine)
        prompts: list = [None] * sum(len(r) for _, r, _ in filter(None, everyone))
        samples: list[list[Rollout]] = [[] for _ in prompts]
        dp = self.rollout_mesh.dp
        for part in filter(None, everyone):
            index, part_rows, part_rollouts = part
            for i, row in enumerate(part_rows):
                prompts[index + i * dp] = row  # back in the step's order: rollout_rows dealt them out so
            for x in part_rollouts:
                samples[index + x.prompt_index * dp].append(x)
        keep = range(self.train_dp, len(prompts), self.train_mesh.dp)
        out_rows = [prompts[i] for i in keep]
        out = [replace(x, prompt_index=j) for j, i in enumerate(keep) for x in samples[i]]
        return out_rows, out


__all__ = ["Shares"]
