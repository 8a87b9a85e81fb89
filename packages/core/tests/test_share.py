"""Serving rollout from the trainer's own tensors: when a plan allows it, and that the lender stays safe."""

import pytest
import torch

from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance.train import fixed_batch, nll
from gearshift.conformance.util import PROMPTS
from gearshift.hybrid import HybridActor
from gearshift.mesh import MeshSpec, Placement
from gearshift.reshard import StreamingResharder, plan_reshard, share_refusal
from gearshift.rollout import SamplingParams
from gearshift.weights import ParamSpec, WeightBucket, WeightError, WeightSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SHAPES = {"a": (8, 4), "b": (6,)}


def spec(mesh, shards=None, dtype=torch.float32):
    shards = shards or {}
    return WeightSpec(mesh, tuple(ParamSpec(n, s, dtype, Placement.of(mesh, shards.get(n, {})))
                                  for n, s in SHAPES.items()))


@pytest.mark.parametrize("src,dst,reason", [
    (spec(MeshSpec()), spec(MeshSpec()), None),
    (spec(MeshSpec(dp=2)), spec(MeshSpec(dp=2)), None),  # a full replica on each rank, both sides
    (spec(MeshSpec()), spec(MeshSpec(), dtype=torch.bfloat16), "wants torch.bfloat16"),
    (spec(MeshSpec(dp=2), {"a": {"dp": 0}}), spec(MeshSpec(dp=2)), "travels from rank"),
    (spec(MeshSpec(tp=2), {"a": {"tp": 0}}), spec(MeshSpec(tp=2), {"a": {"tp": 1}}), "travels from rank"),
], ids=["one-rank", "replicas", "dtype", "fsdp-to-replicas", "row-to-column"])
def test_a_plan_shares_only_when_every_rank_holds_what_it_serves(src, dst, reason):
    why = share_refusal(plan_reshard(src, dst))
    if reason is None:
        assert why is None
    else:
        assert reason in why


@pytest.fixture(scope="module")
def pair(gearshift_model):
    return TorchTrainEngine.build(gearshift_model, lr=1e-2), HFRolloutEngine.build(gearshift_model)


def test_shared_sync_copies_nothing_and_follows_training(pair):
    train, rollout = pair
    actor = HybridActor(train, rollout)
    assert actor.plan.share
    report = actor.to_rollout()
    assert report.phase("share").bytes == 0 and report.phase("load") is None
    lent = train.local_weights(["model.norm.weight"])["model.norm.weight"]
    assert rollout.model.model.norm.weight.data_ptr() == lent.data_ptr()
    before = actor.generate(PROMPTS, GREEDY)
    actor.to_train()
    assert rollout.resident_bytes()["weights"] == 0  # asleep: the borrowed tensors were let go
    for _ in range(3):
        actor.train_step(fixed_batch(), nll)
    actor.to_rollout()
    after = actor.generate(PROMPTS, GREEDY)
    actor.to_train()
    assert [r.logprobs for r in before] != [r.logprobs for r in after]


def test_update_weights_after_sharing_never_writes_into_the_lender(pair):
    train, rollout = pair
    actor = HybridActor(train, rollout)
    actor.to_rollout()
    lent = {n: t.clone() for n, t in train.local_weights(train.weight_spec().names()).items()}
    zeros = {n: torch.zeros_like(t) for n, t in lent.items()}
    rollout.update_weights([WeightBucket(zeros)])  # the engine takes its own copy first
    now = train.local_weights(list(lent))
    assert all(torch.equal(now[n], lent[n]) for n in lent)
    assert all(float(p.abs().sum()) == 0 for p in rollout.model.parameters())
    actor.to_train()


def test_a_tensor_the_engine_cannot_use_as_it_is_is_refused(pair):
    train, rollout = pair
    rollout.wake(["weights"])
    name = "model.norm.weight"
    with pytest.raises(WeightError, match="can be shared"):
        rollout.share_weights([WeightBucket({name: torch.ones(rollout.model.model.norm.weight.shape,
                                                              dtype=torch.float64)})])
    with pytest.raises(WeightError, match="unknown weight"):
        rollout.share_weights([WeightBucket({"no.such.weight": torch.ones(2)})])
    rollout.sleep(["weights", "kv_cache"])


def test_choices_between_sharing_and_copying(pair):
    train, rollout = pair
    assert not HybridActor(train, rollout, StreamingResharder(share=False)).plan.share
    # offloaded params would stay alive in the rollout engine: sharing is dropped, or refused if asked for
    assert not HybridActor(train, rollout, offload_params=True).plan.share
    with pytest.raises(ValueError, match="offload_params"):
        HybridActor(train, rollout, StreamingResharder(share=True), offload_params=True)
    with pytest.raises(ValueError, match="share must be"):
        StreamingResharder(share="yes")


def test_an_engine_that_cannot_borrow_gets_copies(pair):
    train, rollout = pair

    class Copying(HFRolloutEngine):
        can_share_weights = False

    other = Copying.__new__(Copying)
    other.__dict__.update(rollout.__dict__)
    with pytest.raises(WeightError, match="cannot serve from another engine"):
        StreamingResharder(share=True).plan(train, other)
    assert not StreamingResharder().plan(train, other).share


def test_a_bf16_engine_casts_in_its_own_copy(gearshift_model):
    """A float32 trainer and a bfloat16 rollout engine cannot share; the stream then hands over the
    trainer's float32 tensors as they are and the engine casts while copying (no bf16 copies on the way)."""
    train = TorchTrainEngine.build(gearshift_model, lr=1e-2)
    rollout = HFRolloutEngine.build(gearshift_model, dtype="bfloat16")
    seen = []
    update = rollout.update_weights

    def spy(buckets):
        def watch():
            for bucket in buckets:
                seen.extend(t.dtype for t in bucket.tensors.values())
                yield bucket
        return update(watch())

    rollout.update_weights = spy
    actor = HybridActor(train, rollout)
    assert not actor.plan.share and "bfloat16" in StreamingResharder.share_refusal(actor.plan, train, rollout)
    report = actor.to_rollout()
    assert set(seen) == {torch.float32}
    assert report.phase("load").bytes == actor.plan.bytes_received(0) == train.weight_spec().nbytes // 2
    lent = train.local_weights(train.weight_spec().names())
    mine = dict(rollout.model.named_parameters())
    assert all(torch.equal(mine[n], t.to(torch.bfloat16)) for n, t in lent.items())
    actor.to_train()
    with pytest.raises(WeightError, match="floating-point"):
        rollout.wake(["weights"])
        rollout.update_weights([WeightBucket({"model.norm.weight": torch.ones(mine["model.norm.weight"].shape,
                                                                             dtype=torch.int32)})])


def test_a_copying_sync_marks_the_trainers_own_tensors_lent_and_nothing_else(pair):
    """`WeightBucket.lent` tells a rollout engine it may hold the tensors until the next sync: only the trainer's
    own storage, never a cast or gathered copy, and never a LoRA trainer's merged weights."""
    from gearshift.reshard import stream_plan
    from gearshift.reshard.resharders import lends

    train, rollout = pair
    seen, real = [], rollout.update_weights

    def spy(buckets):
        buckets = list(buckets)
        seen.extend(buckets)
        return real(buckets)

    rollout.update_weights = spy
    try:
        actor = HybridActor(train, rollout, StreamingResharder(share=False))
        actor.to_rollout()
        actor.to_train()
    finally:
        del rollout.update_weights
    own = train.local_weights(train.weight_spec().names())
    assert seen and all(b.lent for b in seen)
    assert all(t.data_ptr() == own[n].data_ptr() for b in seen for n, t in b.items())
    assert lends(train)
    src = train.weight_spec()
    narrower = WeightSpec(src.mesh, tuple(ParamSpec(p.name, p.shape, torch.bfloat16, p.placement) for p in src),
                          aliases=src.aliases)
    plan = plan_reshard(src, narrower)
    assert not any(b.lent for b in stream_plan(plan, train.local_weights, lent=True))  # cast on the way
    assert all(b.lent for b in stream_plan(plan, train.local_weights, cast=False, lent=True))
    assert not any(b.lent for b in stream_plan(plan, train.local_weights, cast=False))  # a ZeRO-3 gather


def test_lent_buckets_reach_the_rollout_engine_as_one(pair):
    """Lent buckets hold no memory of their own: the receiver gets them as one bucket, its work per bucket paid
    once a sync, every weight in it; buckets that are copies (cast here) come one by one as planned."""
    from gearshift.reshard import stream_plan

    train, _ = pair
    src = train.weight_spec()
    plan = plan_reshard(src, src, bucket_bytes=max(p.nbytes for p in src))
    assert len(plan.buckets) > 2
    lent = list(stream_plan(plan, train.local_weights, cast=False, lent=True))
    assert len(lent) == 1 and lent[0].lent and set(lent[0].tensors) == set(src.names())
    own = train.local_weights(src.names())
    assert all(t is own[n] for n, t in lent[0].items())
    narrower = WeightSpec(src.mesh, tuple(ParamSpec(p.name, p.shape, torch.bfloat16, p.placement) for p in src),
                          aliases=src.aliases)
    cast_plan = plan_reshard(src, narrower, bucket_bytes=max(p.nbytes for p in narrower))
    cast = list(stream_plan(cast_plan, train.local_weights, lent=True))
    assert len(cast) == len(cast_plan.buckets) > 2 and not any(b.lent for b in cast)


def test_a_sync_of_lent_weights_looks_them_up_once(pair):
    """Every weight lent whole: the sender reads them in one look-up, not one per bucket (its host work per bucket
    was most of a 7B export); with a cast wanted for some weights, the lent ones still come as one bucket and the
    cast ones as planned."""
    from gearshift.reshard import stream_plan

    train, _ = pair
    src = train.weight_spec()
    plan = plan_reshard(src, src, bucket_bytes=max(p.nbytes for p in src))
    calls = {"local_weights": 0, "materialized": 0}

    def counted(name, fn):
        def call(names):
            calls[name] += 1
            return fn(names)
        return call
    look_up, around = counted("local_weights", train.local_weights), counted("materialized", train.materialized)
    (bucket,) = stream_plan(plan, look_up, materialized=around, lent=True)
    assert calls == {"local_weights": 1, "materialized": 1} and len(plan.buckets) > 2
    assert bucket.lent and set(bucket.tensors) == set(src.names())
    some = {p.name for p in src}.pop()
    mixed = WeightSpec(src.mesh, tuple(ParamSpec(p.name, p.shape, torch.bfloat16 if p.name == some else p.dtype,
                                                 p.placement) for p in src), aliases=src.aliases)
    mixed_plan = plan_reshard(src, mixed, bucket_bytes=max(p.nbytes for p in src))
    out = list(stream_plan(mixed_plan, train.local_weights, lent=True))
    assert [b.lent for b in out] == [False, True]
    assert out[0].tensors[some].dtype == torch.bfloat16 and some not in out[1].tensors
    assert set(out[0].tensors) | set(out[1].tensors) == set(src.names())


def test_a_lora_trainer_lends_nothing(gearshift_model):
    from gearshift.reshard.resharders import lends

    assert not lends(TorchTrainEngine.build(gearshift_model, lora_r=2))


def test_before_the_trainer_offloads_its_parameters_the_rollout_engine_lets_go_of_them(pair):
    train, rollout = pair
    events = []
    real_offload = train.offload
    rollout.release_sources = lambda: events.append("release")
    train.offload = lambda tags: (events.append(("offload", tuple(tags))), real_offload(tags))[1]
    try:
        actor = HybridActor(train, rollout, offload_params=True)
        actor.to_rollout()
        actor.to_train()
        plain = HybridActor(train, rollout, StreamingResharder(share=False))
        plain.to_rollout()
        plain.to_train()
    finally:
        del rollout.release_sources, train.offload
    assert events == ["release", ("offload", ("params",))], "once, before the parameters' offload, and only then"
