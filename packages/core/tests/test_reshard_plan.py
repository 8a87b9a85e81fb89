"""Reshard plans worked out without processes, then one run for real over 2 gloo processes."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from gearshift.mesh import MeshSpec, Placement, box_slices
from gearshift.reshard import plan_reshard, stream_plan
from gearshift.weights import ParamSpec, WeightError, WeightSpec

SHAPES = {"embed": (50, 8), "q": (16, 8), "o": (8, 16), "norm": (8,), "odd": (7, 5)}


def full_tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def spec(mesh, shards, dtype=torch.float32):
    return WeightSpec(mesh, tuple(ParamSpec(n, s, dtype, Placement.of(mesh, shards.get(n, {}))) for n, s in SHAPES.items()))


def simulate(plan, full):
    """Build every rank's rollout tensors from the train ranks' shards, following only the plan."""
    out = {}
    for d in range(plan.world_size):
        for p in plan.dst:
            dst_box = p.placement.local_box(p.shape, d)
            buf = torch.full(tuple(hi - lo for lo, hi in dst_box), float("nan"))
            covered = 0
            for t in plan.transfers[p.name]:
                if t.dst != d:
                    continue
                src = plan.src.by_name()[p.name]
                src_box = src.placement.local_box(src.shape, t.src)
                shard = full[p.name][box_slices(src_box)]  # what rank t.src holds
                piece = shard[box_slices(t.box, src_box)]
                region = buf[box_slices(t.box, dst_box)]
                assert torch.isnan(region).all(), "two transfers wrote the same element"
                region.copy_(piece)
                covered += piece.numel()
            assert covered == buf.numel()
            out[(d, p.name)] = buf
    return out


@pytest.mark.parametrize(
    "train_mesh,train_shards,rollout_mesh,rollout_shards",
    [
        (MeshSpec(dp=4, tp=2), {"embed": {"dp": 0, "tp": 1}, "q": {"tp": 0, "dp": 1}, "o": {"tp": 1, "dp": 0},
                                "odd": {"dp": 0}}, MeshSpec(dp=8), {}),
        (MeshSpec(dp=2), {n: {"dp": 0} for n in SHAPES}, MeshSpec(tp=2), {"q": {"tp": 0}, "o": {"tp": 1}, "odd": {"tp": 1}}),
        (MeshSpec(dp=2, tp=2), {"q": {"tp": 0}}, MeshSpec(dp=1, tp=4), {"q": {"tp": 1}, "embed": {"tp": 0}}),
    ],
    ids=["dp4tp2-to-dp8", "dp2-to-tp2", "tp2-to-tp4"],
)
def test_plan_moves_exactly_the_right_slices(train_mesh, train_shards, rollout_mesh, rollout_shards):
    src, dst = spec(train_mesh, train_shards), spec(rollout_mesh, rollout_shards)
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    full = full_tensors()
    got = simulate(plan, full)
    for (d, name), tensor in got.items():
        p = dst.by_name()[name]
        assert torch.equal(tensor, full[name][box_slices(p.placement.local_box(p.shape, d))])
    # every source is a rank that holds the piece, and a rank that holds it keeps it local
    for ts in plan.transfers.values():
        for t in ts:
            s = src.by_name()[t.name]
            box = s.placement.local_box(s.shape, t.src)
            assert all(lo >= b0 and hi <= b1 for (lo, hi), (b0, b1) in zip(t.box, box))
    assert len(plan.buckets) > 1 and sum(len(b.names) for b in plan.buckets) == len(SHAPES)
    # what one rank sends to another is what that one receives from it
    per_rank = [plan.peer_bytes(r) for r in range(plan.world_size)]
    for r, (sent, _) in enumerate(per_rank):
        assert sent == {d: n for d in range(plan.world_size) if (n := per_rank[d][1].get(r))}


def test_replicated_source_sends_nothing_remote():
    plan = plan_reshard(spec(MeshSpec(dp=4), {}), spec(MeshSpec(dp=4), {}))
    assert all(t.src == t.dst for ts in plan.transfers.values() for t in ts)
    assert plan.bytes_sent_remote(0) == 0


def test_mismatches_are_clear_errors():
    with pytest.raises(WeightError, match="same ranks"):
        plan_reshard(spec(MeshSpec(dp=2), {}), spec(MeshSpec(dp=4), {}))
    src = spec(MeshSpec(), {})
    bigger = WeightSpec(src.mesh, src.params + (ParamSpec("extra", (2,), torch.float32, Placement.of(src.mesh)),))
    with pytest.raises(WeightError, match="does not have"):
        plan_reshard(src, bigger)
    assert plan_reshard(bigger, src).unused == ("extra",)
    reshaped = WeightSpec(src.mesh, (ParamSpec("q", (8, 16), torch.float32, Placement.of(src.mesh)),))
    with pytest.raises(WeightError, match="shape"):
        plan_reshard(src, reshaped)


def _worker(rank, world, port, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        full = full_tensors()
        cases = [
            (spec(MeshSpec(dp=2), {n: {"dp": 0} for n in SHAPES}), spec(MeshSpec(dp=2), {})),
            (spec(MeshSpec(dp=2), {n: {"dp": 0} for n in SHAPES}),
             spec(MeshSpec(tp=2), {"q": {"tp": 0}, "o": {"tp": 1}, "odd": {"tp": 1}}, torch.bfloat16)),
            (spec(MeshSpec(tp=2), {"o": {"tp": 1}}), spec(MeshSpec(dp=2), {"o": {"dp": 0}, "embed": {"dp": 1}})),
        ]
        bad = 0
        sizes = []  # messages per exchange: one per peer and dtype, however many slices travel
        batch = dist.batch_isend_irecv

        def counting(ops):
            sizes.append(len(ops))
            return batch(ops)

        dist.batch_isend_irecv = counting
        for src, dst in cases:
            plan = plan_reshard(src, dst, bucket_bytes=600)
            mine = {p.name: full[p.name][box_slices(p.placement.local_box(p.shape, rank))].clone() for p in src}
            seen = set()
            for bucket in stream_plan(plan, lambda names: {n: mine[n] for n in names}):
                for name, tensor in bucket.items():
                    p = dst.by_name()[name]
                    want = full[name][box_slices(p.placement.local_box(p.shape, rank))].to(p.dtype)
                    bad += not torch.equal(tensor, want)
                    seen.add(name)
            bad += seen != set(SHAPES)
        dist.batch_isend_irecv = batch
        bad += not sizes or max(sizes) > 2  # a send and a receive with the one peer
        results[rank] = bad
    finally:
        dist.destroy_process_group()


def test_plan_runs_for_real_over_two_gloo_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, port, results), nprocs=2, join=True)
    assert dict(results) == {0: 0, 1: 0}


def test_weights_are_copied_large_ones_one_by_one_and_small_ones_batched(monkeypatch):
    import torch

    from gearshift.weights import copy_weights_

    batched = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (batched.append(len(d)), real(d, s)))
    dsts = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(256, dtype=torch.bfloat16), torch.zeros(3)]
    srcs = [torch.arange(4.0), torch.arange(256.0), torch.arange(3.0)]
    copy_weights_(dsts, srcs, large=256 * 2)  # the second is 512 bytes: copied by itself
    assert batched == [2]
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype))  # cast as copy_ casts
    batched.clear()
    copy_weights_(dsts[1:2], srcs[1:2], large=256 * 2)
    assert batched == []
