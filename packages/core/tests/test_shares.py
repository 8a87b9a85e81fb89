"""Dealing a step's prompts out by rollout dp index and its samples by train dp index."""

import pytest

from gearshift import dist as gdist
from gearshift.mesh import MeshSpec
from gearshift.rl.shares import Shares
from gearshift.rollout import Rollout

ROWS = [{"prompt_ids": [i], "i": i} for i in range(8)]


def rollout_on(rank: int, mesh: MeshSpec, n: int = 2) -> tuple[list, list[Rollout]]:
    """What `rank` generates for its share: n samples of each of its prompts, numbered within the share."""
    rows = Shares(mesh, mesh, rank).rollout_rows(ROWS)
    return rows, [Rollout(r["prompt_ids"], [r["i"], k], [0.0, 0.0], "length", prompt_index=j, sample_index=k)
                  for j, r in enumerate(rows) for k in range(n)]


def run_step(rollout_mesh: MeshSpec, train_mesh: MeshSpec, monkeypatch) -> dict[int, tuple[list, list[Rollout]]]:
    world = rollout_mesh.world_size
    made = {r: rollout_on(r, rollout_mesh) for r in range(world)}
    out = {}
    for rank in range(world):
        shares = Shares(rollout_mesh, train_mesh, rank)
        others = [(Shares(rollout_mesh, train_mesh, r).rollout_dp, *made[r])
                  if rollout_mesh.coords(r)["tp"] == 0 else None for r in range(world)]
        monkeypatch.setattr(gdist, "all_gather_object", lambda value: others)
        out[rank] = shares.to_train(*made[rank])
    return out


def test_the_same_dealing_keeps_each_ranks_own_samples(monkeypatch):
    mesh = MeshSpec(dp=2)
    assert Shares(mesh, mesh, 1).same and Shares(MeshSpec(tp=2), MeshSpec(sp=2), 0).same
    assert [r["i"] for r in Shares(mesh, mesh, 1).rollout_rows(ROWS)] == [1, 3, 5, 7]


@pytest.mark.parametrize("rollout_mesh,train_mesh", [
    (MeshSpec(tp=2), MeshSpec(dp=2)), (MeshSpec(dp=2), MeshSpec(tp=2)), (MeshSpec(dp=2), MeshSpec(sp=2)),
    (MeshSpec(dp=2, tp=2), MeshSpec(dp=4)), (MeshSpec(dp=4), MeshSpec(dp=2, tp=2)),
], ids=str)
def test_samples_are_dealt_out_again_by_train_dp_index(rollout_mesh, train_mesh, monkeypatch):
    shares = run_step(rollout_mesh, train_mesh, monkeypatch)
    replicas: dict[int, set] = {}
    for rank, (rows, rollouts) in shares.items():
        dp = train_mesh.coords(rank)["dp"]
        assert [r["i"] for r in rows] == list(range(dp, 8, train_mesh.dp))  # the step's prompts, dealt by train dp
        for x in rollouts:  # each sample with its own prompt, renumbered within the share, all of a prompt's kept
            assert rows[x.prompt_index]["prompt_ids"] == x.prompt_ids == [x.token_ids[0]]
        assert sorted((x.prompt_ids[0], x.sample_index) for x in rollouts) == \
            [(r["i"], k) for r in rows for k in range(2)]
        replicas.setdefault(dp, set()).add(repr(rollouts))
    assert all(len(v) == 1 for v in replicas.values())  # tp and sp peers train on the same samples
