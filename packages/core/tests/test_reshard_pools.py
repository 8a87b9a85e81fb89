"""Reshard plans between separate pools of ranks: worked out without processes, then run over a gloo `Link`."""

import datetime
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from gearshift.mesh import MeshSpec, Placement, box_slices
from gearshift.reshard import Link, open_store, plan_between_pools, plan_reshard, share_refusal, stream_plan
from gearshift.weights import ParamSpec, WeightError, WeightSpec

SHAPES = {"embed": (50, 8), "q": (16, 8), "o": (8, 16), "norm": (8,), "odd": (7, 5)}


def full_tensors():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def spec(mesh, shards, dtype=torch.float32):
    return WeightSpec(mesh, tuple(ParamSpec(n, s, dtype, Placement.of(mesh, shards.get(n, {})))
                                  for n, s in SHAPES.items()))


def local(spec_, rank, full):
    """What global rank `rank` holds of each weight under `spec_`."""
    i = spec_.mesh_rank(rank)
    return {p.name: full[p.name][box_slices(p.placement.local_box(p.shape, i))] for p in spec_}


CASES = {
    "fsdp2-to-2replicas": (spec(MeshSpec(dp=2), {n: {"dp": 0} for n in SHAPES}), spec(MeshSpec(dp=2), {})),
    "fsdp2-to-tp2": (spec(MeshSpec(dp=2), {n: {"dp": 0} for n in SHAPES}),
                     spec(MeshSpec(tp=2), {"q": {"tp": 0}, "o": {"tp": 1}, "odd": {"tp": 1}})),
    "replicas2-to-1": (spec(MeshSpec(dp=2), {}), spec(MeshSpec(), {})),
    "1-to-tp2": (spec(MeshSpec(), {}), spec(MeshSpec(tp=2), {"q": {"tp": 0}, "embed": {"tp": 1}})),
    "tp2dp2-to-dp3": (spec(MeshSpec(dp=2, tp=2), {"q": {"tp": 0}, "o": {"tp": 1, "dp": 0}, "embed": {"dp": 0}}),
                      spec(MeshSpec(dp=3), {"embed": {"dp": 0}})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_train_rank_sends_exactly_the_slices_each_rollout_rank_wants(case):
    train, rollout = CASES[case]
    plan = plan_between_pools(train, rollout, bucket_bytes=700)
    senders, receivers = plan.src.global_ranks, plan.dst.global_ranks
    assert not set(senders) & set(receivers) and plan.ranks == tuple(range(len(senders) + len(receivers)))
    full = full_tensors()
    held = {r: local(plan.src, r, full) for r in senders}
    for d in receivers:
        j = plan.dst.mesh_rank(d)
        for p in plan.dst:
            box = p.placement.local_box(p.shape, j)
            got = torch.full(tuple(hi - lo for lo, hi in box), float("nan"))
            for t in plan.transfers[p.name]:
                if t.dst != d:
                    continue
                assert t.src in senders
                src_box = plan.src.by_name()[p.name].placement.local_box(p.shape, plan.src.mesh_rank(t.src))
                region = got[box_slices(t.box, box)]
                assert torch.isnan(region).all(), "two transfers wrote the same element"
                region.copy_(held[t.src][p.name][box_slices(t.box, src_box)])  # only what that rank holds
            assert torch.equal(got, full[p.name][box_slices(box)]), (d, p.name)
    for r in senders:  # a sender sends, receives nothing, and serves no rollout tensors
        sent, received = plan.peer_bytes(r)
        assert received == {} and set(sent) <= set(receivers) and plan.bytes_received(r) == 0
        assert all(plan.rank_view(r, n).shape is None for n in SHAPES)
    # no gather: what the train ranks send in all is what lands on the rollout ranks
    assert sum(sum(plan.peer_bytes(r)[0].values()) for r in senders) == sum(plan.bytes_received(d) for d in receivers)
    assert "separate pools" in share_refusal(plan)


def test_replicas_spread_the_sending_over_the_train_ranks():
    plan = plan_between_pools(spec(MeshSpec(dp=2), {}), spec(MeshSpec(dp=2), {}))
    assert {(t.src, t.dst) for ts in plan.transfers.values() for t in ts} == {(0, 2), (1, 3)}


def test_specs_name_their_ranks_once_each():
    with pytest.raises(WeightError, match="one per rank"):
        spec(MeshSpec(dp=2), {}).on_ranks([3])
    with pytest.raises(WeightError, match="repeat"):
        spec(MeshSpec(dp=2), {}).on_ranks([3, 3])
    with pytest.raises(WeightError, match="on_ranks"):  # unnamed ranks still mean one pool of equal size
        plan_reshard(spec(MeshSpec(dp=2), {}), spec(MeshSpec(dp=3), {}))


def _pool_worker(rank, n_train, n_roll, ports, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    train = rank < n_train
    pool_rank, pool_size = (rank, n_train) if train else (rank - n_train, n_roll)
    # each pool has its own default group, as under Ray
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0 if train else 1]))
    dist.init_process_group("gloo", rank=pool_rank, world_size=pool_size,
                            timeout=datetime.timedelta(seconds=120))
    size = n_train + n_roll
    store = dist.TCPStore("127.0.0.1", ports[2], size, rank == 0, timeout=datetime.timedelta(seconds=120))
    link = Link("127.0.0.1", ports[2], rank, size, store=store, timeout_s=120)
    try:
        full = full_tensors()
        bad = []
        cases = [(spec(MeshSpec(dp=n_train), {n: {"dp": 0} for n in SHAPES}), spec(MeshSpec(dp=n_roll), {})),
                 (spec(MeshSpec(dp=n_train), {n: {"dp": 0} for n in SHAPES}),
                  spec(MeshSpec(tp=n_roll), {"q": {"tp": 0}, "o": {"tp": 1}}, torch.bfloat16))]
        for k, (tspec, rspec) in enumerate(cases):
            plan = plan_between_pools(tspec, rspec, bucket_bytes=600)
            if train:
                mine = {n: t.clone() for n, t in local(plan.src, rank, full).items()}
                buckets = list(stream_plan(plan, lambda names: {n: mine[n] for n in names}, rank=rank, group=link))
                bad += [f"case {k}: a sender got tensors"] if any(len(b) for b in buckets) else []
            else:
                seen = {}
                for bucket in stream_plan(plan, None, rank=rank, group=link):
                    seen.update(bucket.items())
                want = local(plan.dst, rank, full)
                bad += [f"case {k}: {n}" for n, p in plan.dst.by_name().items()
                        if not torch.equal(seen[n], want[n].to(p.dtype))]
        if link.bandwidth(0, n_train, nbytes=1 << 20, repeats=1) is None and rank in (0, n_train):
            bad.append("no bandwidth measured")
        results[rank] = bad
    finally:
        link.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("n_train,n_roll", [(1, 1), (2, 2)])
def test_weights_cross_between_two_gloo_pools(n_train, n_roll):
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    results = mp.Manager().dict()
    mp.spawn(_pool_worker, args=(n_train, n_roll, ports, results), nprocs=n_train + n_roll, join=True)
    assert dict(results) == {r: [] for r in range(n_train + n_roll)}


def test_open_store_serves_a_free_port():
    store = open_store("127.0.0.1", 1, timeout_s=10)
    assert store.port > 0
