"""The weight spec describes the real DTensor shards, and exporting them costs one bucket of memory.

Meaningful with any number of processes; test_two_processes.py runs this file
under torchrun with two, where the weights are really split and the export to
the `hf` rollout engine goes point to point.
"""

import json
import math
import os
import time

import pytest
import torch
from gearshift import dist as gdist
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.conformance.train import fixed_batch, nll
from gearshift.conformance.util import reference_weights
from gearshift.mesh import box_slices
from gearshift.reshard import StreamingResharder, export_weights, plan_reshard
from torch.profiler import ProfilerActivity, profile

from gearshift_fsdp.engine import FSDPTrainEngine


@pytest.fixture(scope="module")
def engine(gearshift_model):
    options = json.loads(os.environ.get("GEARSHIFT_FSDP_OPTIONS", "{}"))  # set by a launcher (hybrid sharding)
    return FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32", one_rank="fsdp", **options)


def peak_cpu_bytes(fn) -> int:
    """The most CPU memory (bytes) allocated through torch and not yet freed at any moment while `fn` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for _, nbytes in sorted(records, key=lambda r: r[0]):  # stable: equal times keep their recorded order
        live += nbytes
        peak = max(peak, live)
    return peak


def one_bucket_bytes(plan, rank: int) -> int:
    """The most any one bucket allocates on `rank`: its output, plus one packed buffer of the pieces it
    receives and one of the pieces it sends (a message per peer)."""
    dst = plan.dst.by_name()
    worst = 0
    for bucket in plan.buckets:
        out = sum(dst[n].dtype.itemsize * math.prod(dst[n].placement.local_shape(dst[n].shape, rank))
                  for n in bucket.names)
        moved = sum(dst[n].dtype.itemsize * math.prod(hi - lo for lo, hi in t.box)
                    for n in bucket.names for t in plan.transfers[n] if rank in (t.src, t.dst) and t.src != t.dst)
        worst = max(worst, out + moved)
    return worst


def test_weight_spec_matches_the_local_shards(engine):
    spec, rank, world = engine.weight_spec(), gdist.rank(), gdist.world_size()
    assert spec.mesh.world_size == world
    local = engine.local_weights(spec.names())
    for p in spec:
        assert tuple(local[p.name].shape) == p.placement.local_shape(p.shape, rank), p.name
    assert set(spec.names()) == {n for n, _ in engine.model.named_parameters()}
    if spec.mesh.dp * spec.mesh.sp > 1:  # FSDP2 shards every parameter on dim 0 (over dp x sp)
        assert all(not p.placement.is_replicated() for p in spec), [str(p.placement) for p in spec]
    if spec.mesh.tp > 1:  # the model's tensor-parallel plan: attention and MLP projections cut over tp
        cut = {p.name for p in spec if "tp:" in str(p.placement)}
        assert {n for n in spec.names() if n.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight"))} <= cut
        assert not any("norm" in n or "embed" in n for n in cut)
    if world > 1:
        assert sum(t.numel() for t in local.values()) < sum(p.nbytes // 4 for p in spec)


def test_local_shards_are_the_model_weights(engine, gearshift_model):
    spec = engine.weight_spec()
    want = reference_weights(gearshift_model, spec)  # cut to this rank's slice by the spec's placements
    got = engine.local_weights(spec.names())
    for name in spec.names():
        assert torch.equal(got[name], want[name]), name


def test_plan_to_hf_rollout_sends_point_to_point(engine, gearshift_model):
    rollout = HFRolloutEngine.build(gearshift_model, mesh=os.environ.get("GEARSHIFT_HF_MESH") or None)
    plan = plan_reshard(engine.weight_spec(), rollout.weight_spec())
    rank, world = gdist.rank(), gdist.world_size()
    print(f"rank {rank}: {plan.describe(rank)}")
    engine.train_step(fixed_batch(), nll)
    full = {k: v.clone() for b in export_weights(engine) for k, v in b.items()}
    t0 = time.perf_counter()
    StreamingResharder().sync(plan, engine, rollout)
    seconds = time.perf_counter() - t0
    print(f"FIGURE world={world} sync fsdp->hf of {plan.bytes_received(rank) / 2**20:.2f} MiB: {seconds * 1e3:.1f} ms")
    # asserted after every collective, so that a failure on one rank cannot leave the others waiting
    for p in rollout.weight_spec():  # each rank holds exactly its slice of the rollout layout
        want = full[p.name][box_slices(p.placement.local_box(p.shape, rank))]
        assert torch.equal(rollout._local[p.name].detach(), want), p.name
    remote = [t for ts in plan.transfers.values() for t in ts if t.src != t.dst]
    if world > 1:  # each rank holds a part, so each receives the rest from others
        assert all(any(t.dst == r for t in remote) for r in range(world))
        if all(p.placement.is_replicated() for p in rollout.weight_spec()):  # whole replicas: half comes from afar
            assert sum(plan.bytes_sent_remote(r) for r in range(world)) >= plan.bytes_received(rank) // 2
    else:
        assert not remote


def test_export_peak_memory_is_one_bucket(engine):
    spec = engine.weight_spec()
    bucket_bytes = max(p.nbytes for p in spec)
    plan = plan_reshard(spec, spec.replicated(), bucket_bytes)
    assert len(plan.buckets) >= 4
    largest = max(b.nbytes for b in plan.buckets)
    sizes = []

    def export_dropping_each_bucket():
        sizes.clear()
        stream = export_weights(engine, bucket_bytes=bucket_bytes)
        while (bucket := next(stream, None)) is not None:
            sizes.append(bucket.nbytes)
            del bucket  # a loader done with a bucket lets it go before asking for the next

    def export_in_a_for_loop():
        for bucket in export_weights(engine, bucket_bytes=bucket_bytes):
            pass  # `bucket` holds the previous bucket while the next one is built

    t0 = time.perf_counter()
    export_dropping_each_bucket()
    seconds = time.perf_counter() - t0
    peak = peak_cpu_bytes(export_dropping_each_bucket)
    peak_for_loop = peak_cpu_bytes(export_in_a_for_loop)
    # the measuring is live: a whole-model copy shows up as such
    shards = list(engine.local_weights(spec.names()).values())
    assert peak_cpu_bytes(lambda: torch.cat([t.flatten() for t in shards])) >= sum(t.nbytes for t in shards)
    print(f"FIGURE world={gdist.world_size()} export of {spec.nbytes / 2**10:.0f} KiB in {len(sizes)} buckets "
          f"(largest {largest / 2**10:.0f} KiB): {seconds * 1e3:.1f} ms, peak extra {peak / 2**10:.0f} KiB "
          f"({peak_for_loop / 2**10:.0f} KiB consumed by a for loop)")
    assert sum(sizes) == spec.nbytes and max(sizes) == largest
    bound = one_bucket_bytes(plan, gdist.rank()) + 4096  # a little room for the allocator's own rounding
    assert peak <= bound, f"export peaked at {peak} bytes, more than one bucket and its message buffers ({bound})"
    assert peak_for_loop <= bound + largest, f"export in a for loop peaked at {peak_for_loop} bytes"
    assert bound < spec.nbytes  # else one bucket would be the whole model and the bound would prove nothing
