"""What ZeRO changes: full shapes in the weight spec, partitions, per-bucket gathers, training like plain torch.

Meaningful with any number of processes; test_two_processes.py runs this file
under torchrun with two, where ZeRO really partitions.
"""

import math
import time
import weakref
from contextlib import contextmanager

import pytest
import torch
from gearshift import dist as gdist
from gearshift import registry
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.conformance.train import fixed_batch, full_weights, nll
from gearshift.conformance.util import PROMPTS, reference_weights
from gearshift.hybrid import HybridActor
from gearshift.models import build_model
from gearshift.module_train import position_ids
from gearshift.reshard import StreamingResharder, export_weights, plan_reshard
from gearshift.rollout import SamplingParams
from gearshift.train import token_logprobs
from gearshift.weights import WeightError
from torch.profiler import ProfilerActivity, profile

from gearshift_deepspeed import gather
from gearshift_deepspeed.engine import DeepSpeedTrainEngine

STAGES = [1, 2, 3]
#: widths no world size above 1 divides (33, 45, 321): most weights' ZeRO-3 partitions are padded; the head is tied
ODD = dict(hidden_size=33, intermediate_size=45, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
           head_dim=10, max_position_embeddings=512, vocab_size=321)


def build(model, **options):
    return DeepSpeedTrainEngine.build(model, **{"lr": 1e-2, "param_dtype": "float32", **options})


@pytest.fixture(scope="module")
def odd_model(gearshift_shared_tmp_root):
    path = gearshift_shared_tmp_root / "odd-widths"
    if gdist.rank() == 0:
        build_model(path, preset=ODD)
    gdist.barrier()
    return str(path)


def hf_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask))
    return token_logprobs(out.logits, batch.input_ids).logprobs


def reference_step(model_path: str, lr: float = 1e-2, max_grad_norm: float | None = 1.0, steps: int = 1):
    """Plain transformers and torch: AdamW steps on the suite's batch, clipped as the engines clip.

    Every rank computes it on the whole batch; the engines see that same batch on every
    rank, so their gradient (the mean over ranks) is this one.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch, norms = fixed_batch(), []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask))
        nll(token_logprobs(out.logits, batch.input_ids), batch)[0].backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)))
        opt.step()
    model.eval()
    return model, norms


def peak_cpu_bytes(fn) -> int:
    """The most CPU memory (bytes) allocated through torch and not yet freed at any moment while `fn` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for _, nbytes in sorted(records, key=lambda r: r[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stage", STAGES)
def test_weight_spec_has_full_shapes_and_gathers_to_the_model(gearshift_model, stage):
    from transformers import AutoModelForCausalLM

    engine = build(gearshift_model, zero_stage=stage)
    spec = engine.weight_spec()
    hf = dict(AutoModelForCausalLM.from_pretrained(gearshift_model).named_parameters())
    assert spec.names() == [n for n in hf if n in spec.by_name()] and len(spec) == len(hf)
    assert all(p.shape == tuple(hf[p.name].shape) and p.placement.is_replicated() for p in spec)
    want = reference_weights(gearshift_model, spec)
    names = spec.names()
    with engine.materialized(names):
        got = {n: t.clone() for n, t in engine.local_weights(names).items()}
    assert all(torch.equal(got[n], want[n]) for n in names)
    if stage == 3:  # outside a gather a parameter holds nothing; its partition is this rank's share
        world = gdist.world_size()
        for name, p in engine.trained.items():
            assert p.numel() == 0 and p.ds_tensor.numel() == math.ceil(p.ds_numel / world), name


@pytest.mark.parametrize("stage", STAGES)
def test_logprobs_match_transformers_after_the_same_step_as_the_torch_backend(gearshift_model, stage):
    reference, ref_norms = reference_step(gearshift_model)
    batch = fixed_batch()
    want = hf_logprobs(reference, batch)
    engine = build(gearshift_model, zero_stage=stage)
    metrics = engine.train_step(batch, nll)
    got = engine.forward_logprobs(batch).logprobs
    mask = batch.attention_mask.bool()
    diff = float((got - want)[mask].abs().max())
    print(f"FIGURE world={gdist.world_size()} zero_stage={stage}: logprobs after one step vs transformers "
          f"+ AdamW: max abs diff {diff:.3g}")
    assert diff <= 1e-5
    assert metrics["grad_norm"] == pytest.approx(ref_norms[0], rel=1e-5)
    if gdist.world_size() == 1:  # the torch backend takes the same step (it runs in one process only)
        torch_engine = registry.create("train", "torch", model=gearshift_model, lr=1e-2)
        torch_engine.train_step(batch, nll)
        torch_diff = float((torch_engine.forward_logprobs(batch).logprobs - got)[mask].abs().max())
        print(f"FIGURE zero_stage={stage}: logprobs after one step vs the torch backend: max abs diff {torch_diff:.3g}")
        assert torch_diff <= 1e-5


def test_clipping_uses_the_global_norm_before_clipping(gearshift_model):
    batch = fixed_batch()
    free, clipped = build(gearshift_model, max_grad_norm=None), build(gearshift_model, max_grad_norm=1e-3)
    ref_free, free_norms = reference_step(gearshift_model, max_grad_norm=None, steps=2)
    ref_clipped, clipped_norms = reference_step(gearshift_model, max_grad_norm=1e-3, steps=2)
    reported = [free.train_step(batch, nll)["grad_norm"] for _ in range(2)]
    reported_clipped = [clipped.train_step(batch, nll)["grad_norm"] for _ in range(2)]
    assert reported == pytest.approx(free_norms, rel=1e-5)
    assert reported_clipped == pytest.approx(clipped_norms, rel=1e-5)  # the norm before clipping
    assert reported_clipped[0] == pytest.approx(reported[0], rel=1e-6)
    mask = batch.attention_mask.bool()
    # Adam's first step does not see a uniform scaling of the gradient; the second does
    for engine, ref, other in ((free, ref_free, ref_clipped), (clipped, ref_clipped, ref_free)):
        got = engine.forward_logprobs(batch).logprobs
        assert float((got - hf_logprobs(ref, batch))[mask].abs().max()) <= 1e-5
        assert float((got - hf_logprobs(other, batch))[mask].abs().max()) > 1e-3


def test_micro_batches_accumulate_to_the_same_step(gearshift_model):
    def per_sequence_nll(out, batch):  # a mean over sequences: micro-batches weigh in by their sequences
        return -(out.logprobs * batch.loss_mask).sum() / batch.size, {}

    results = []
    for size in (None, 1):
        engine = build(gearshift_model, micro_batch_size=size, max_grad_norm=None)
        metrics = engine.train_step(fixed_batch(), per_sequence_nll)
        results.append((metrics, full_weights(engine)))
    (whole, w_whole), (micro, w_micro) = results
    assert micro["loss"] == pytest.approx(whole["loss"], rel=1e-6)  # the same sums, added in another order
    assert micro["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    for name in w_whole:
        torch.testing.assert_close(w_micro[name], w_whole[name], rtol=0, atol=1e-5, msg=name)


def one_bucket_bytes(plan, spec) -> int:
    """The most one bucket can hold gathered on a rank: its weights whole, plus the largest of them again
    (DeepSpeed's all-gather stages one parameter at a time)."""
    full = spec.by_name()
    return max(b.nbytes + max(full[n].nbytes for n in b.names) for b in plan.buckets)


@pytest.mark.skipif(gdist.world_size() > 1, reason="with several ranks gloo frees the all-gather's buffers on its "
                    "own threads, which the profiler does not always see: the next test counts live tensors instead")
def test_zero3_export_peak_memory_is_one_bucket(gearshift_model):
    engine = build(gearshift_model, zero_stage=3)
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
            pass  # `bucket` holds the previous bucket while the next one is gathered

    t0 = time.perf_counter()
    export_dropping_each_bucket()
    seconds = time.perf_counter() - t0
    peak = peak_cpu_bytes(export_dropping_each_bucket)
    peak_for_loop = peak_cpu_bytes(export_in_a_for_loop)
    print(f"FIGURE world={gdist.world_size()} zero3 export of {spec.nbytes / 2**10:.0f} KiB in {len(sizes)} "
          f"buckets (largest {largest / 2**10:.0f} KiB): {seconds * 1e3:.1f} ms, peak extra {peak / 2**10:.0f} KiB "
          f"({peak_for_loop / 2**10:.0f} KiB consumed by a for loop)")
    assert sum(sizes) == spec.nbytes and max(sizes) == largest
    bound = one_bucket_bytes(plan, spec) + 4096  # a little room for the allocator's own rounding
    assert peak <= bound, f"export peaked at {peak} bytes, more than one gathered bucket ({bound})"
    assert peak_for_loop <= bound + largest, f"export in a for loop peaked at {peak_for_loop} bytes"
    # the measuring is live: a whole-model copy shows up as such
    shards = list(full_weights(engine).values())
    assert peak_cpu_bytes(lambda: torch.cat([t.flatten() for t in shards])) >= spec.nbytes
    assert peak < spec.nbytes / 2


def test_zero3_export_holds_one_gathered_bucket_at_a_time(gearshift_model):
    """Counted on the tensors themselves (any number of ranks): when a bucket's gather starts, no weight of an
    earlier bucket is still referenced, by the stream or anyone, once the consumer has let its bucket go."""
    engine = build(gearshift_model, zero_stage=3)
    spec = engine.weight_spec()
    bucket_bytes = max(p.nbytes for p in spec)
    handed_out: list[weakref.ref] = []
    alive_at_gather: list[int] = []
    gather, read = engine.materialized, engine.local_weights

    def watched_gather(names):
        alive_at_gather.append(sum(t.nbytes for ref in handed_out if (t := ref()) is not None))
        return gather(names)

    def watched_read(names):
        out = read(names)
        handed_out.extend(weakref.ref(t) for t in out.values())
        return out

    engine.materialized, engine.local_weights = watched_gather, watched_read
    stream = export_weights(engine, bucket_bytes=bucket_bytes)
    sizes = []
    while (bucket := next(stream, None)) is not None:
        sizes.append(bucket.nbytes)
        del bucket
    assert len(sizes) >= 4 and sum(sizes) == spec.nbytes
    assert alive_at_gather == [0] * len(sizes), alive_at_gather


def test_zero3_copies_to_the_rollout_engine_where_stage2_may_lend(gearshift_model):
    rollout = HFRolloutEngine.build(gearshift_model)
    zero3, zero2 = build(gearshift_model, zero_stage=3), build(gearshift_model, zero_stage=2)
    assert not zero3.can_lend_weights and zero2.can_lend_weights
    assert not HybridActor(zero3, rollout).plan.share
    with pytest.raises(WeightError, match="cannot share"):
        HybridActor(zero3, rollout, StreamingResharder(share=True))
    zero3.train_step(fixed_batch(), nll)
    actor = HybridActor(zero3, rollout)
    actor.to_rollout()
    synced = {n: t.detach().clone() for n, t in rollout._params.items()}
    actor.to_train()
    weights = full_weights(zero3)
    assert all(torch.equal(synced[n], weights[n]) for n in weights if n in synced)


@pytest.mark.parametrize("stage", STAGES)
def test_offload_goes_through_deepspeed_and_refuses_work_while_away(gearshift_model, stage):
    engine, twin = build(gearshift_model, zero_stage=stage), build(gearshift_model, zero_stage=stage)
    batch = fixed_batch()
    engine.train_step(batch, nll)
    twin.train_step(batch, nll)
    moved = engine.offload(["optimizer", "grads"]) + engine.offload(["params"])
    assert moved == 0  # a CPU: the state is in host memory already, nothing is copied
    deepspeed_moved = {s.value for s in engine.ds.optimizer.offloaded_states}
    expected = {"lp_params", "lp_grads", "hp_params", "optim_states"} if stage < 3 else \
        {"lp_params", "lp_grads", "contiguous_grad_buffer"}  # stage 3 moves master weights only for FusedAdam
    assert expected <= deepspeed_moved
    for action in (lambda: engine.train_step(batch, nll), lambda: engine.forward_logprobs(batch),
                   lambda: full_weights(engine)):
        with pytest.raises(RuntimeError, match="offloaded"):
            action()
    engine.onload(["params"])  # the rest stays away
    assert not {"lp_params"} & {s.value for s in engine.ds.optimizer.offloaded_states}
    assert {"hp_params", "optim_states"} <= {s.value for s in engine.ds.optimizer.offloaded_states} or stage == 3
    assert torch.equal(engine.forward_logprobs(batch).logprobs, twin.forward_logprobs(batch).logprobs)
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.train_step(batch, nll)
    engine.onload()
    assert not engine.ds.optimizer.offloaded_states
    assert engine.train_step(batch, nll) == twin.train_step(batch, nll)
    a, b = full_weights(engine), full_weights(twin)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero3_moves_its_state_with_the_heap_frozen_and_gives_it_back_as_found(gearshift_model, stage,
                                                                             monkeypatch):
    """ZeRO-3's `offload_states` ends in a full garbage collection of the process (0.45-0.5 s beside SGLang's
    host side on 2 cores, at every offload): the heap is frozen for it, and afterwards frozen exactly as before
    (a vLLM engine's freeze stays). ZeRO-1/2 collects to free what it clears: left as it is."""
    import gc

    engine = build(gearshift_model, zero_stage=stage)
    engine.train_step(fixed_batch(), nll)
    seen, real = [], engine.ds.offload_states
    monkeypatch.setattr(engine.ds, "offload_states",
                        lambda *a, **k: (seen.append(gc.get_freeze_count()), real(*a, **k))[1])
    before = gc.get_freeze_count()
    engine.offload(["optimizer", "grads"])
    engine.onload()
    assert seen and gc.get_freeze_count() == before
    if stage == 3:
        assert all(n > 0 for n in seen), "DeepSpeed's collection walked the whole heap"
    elif before == 0:
        assert seen == [0] * len(seen)


def test_value_head_trains_and_saves(gearshift_model, gearshift_shared_tmp):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine = build(gearshift_model, value_head=True)

    def value_loss(out, batch):
        return ((out.values - 1.0) ** 2 * batch.loss_mask).sum() / batch.loss_mask.sum(), {}

    values = engine.forward_logprobs(fixed_batch()).values
    losses = [engine.train_step(fixed_batch(), value_loss)["loss"] for _ in range(3)]
    engine.save_hf(str(gearshift_shared_tmp / "critic"))
    weights = full_weights(engine)
    assert values.shape == fixed_batch().input_ids.shape and not values.any()  # the head starts at zero
    assert losses[-1] < losses[0]
    lm = AutoModelForCausalLM.from_pretrained(str(gearshift_shared_tmp / "critic"), dtype=torch.float32)
    theirs = dict(lm.named_parameters())
    mine = {k[len("lm."):]: v for k, v in weights.items() if k.startswith("lm.")}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k].detach()) for k in mine)
    head = load_file(str(gearshift_shared_tmp / "critic" / "value_head.safetensors"))
    assert all(torch.equal(head[k], weights[f"value_head.{k}"]) for k in head) and len(head) == 2


def test_an_untied_head_is_its_own_weight(tmp_path_factory, gearshift_model, gearshift_shared_tmp):
    from transformers import AutoModelForCausalLM

    path = gearshift_shared_tmp / "untied"
    if gdist.rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(gearshift_model, tie_word_embeddings=False)
        with torch.no_grad():
            model.lm_head.weight.copy_(-model.model.embed_tokens.weight)  # the file holds no head: it is new here
        model.save_pretrained(path)
    gdist.barrier()
    engine = build(str(path))
    names = engine.weight_spec().names()
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    weights = full_weights(engine)
    assert torch.equal(weights["lm_head.weight"], -weights["model.embed_tokens.weight"])
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    engine.save_hf(str(gearshift_shared_tmp / "saved"))
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(gearshift_shared_tmp / "saved")).named_parameters())
    after = full_weights(engine)
    assert all(torch.equal(after[k], loaded[k].detach()) for k in names)


def test_no_op_is_compiled_and_torch_keeps_its_linear(gearshift_model):
    import deepspeed.comm.comm as ds_comm

    linear = torch.nn.functional.linear
    build(gearshift_model, zero_stage=3).train_step(fixed_batch(), nll)
    assert ds_comm.cdb.shm_comm_op is None  # the shared-memory all-reduce op was not built
    assert torch.nn.functional.linear is linear  # ZeRO-3's memory_efficient_linear is off


@pytest.mark.parametrize("stage", [2, 3])
def test_a_closed_engine_is_freed(gearshift_model, stage):
    """ZeRO-3 keeps its model on a module-level stack, and the model's hooks hold DeepSpeed's engine, and after
    a second forward its coordinator's class-level cache holds the modules: close takes them off, so a process
    that builds engines one after another (the suite, a benchmark) does not keep every one of them."""
    import gc

    engine = build(gearshift_model, zero_stage=stage)
    engine.forward_logprobs(fixed_batch())  # then a second forward: ZeRO-3's coordinator caches per module
    engine.train_step(fixed_batch(), nll)
    ds, model = weakref.ref(engine.ds), weakref.ref(engine.hf_model)
    engine.close()
    del engine
    gc.collect()
    assert ds() is None and model() is None


@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_with_different_rows_and_packed_micro_batches_step_as_one_batch(gearshift_model, stage):
    """Each rank has its own rows (7 on rank 0, 1 on the others under torchrun), packed by length into
    micro-batches: ZeRO's collectives in every forward and backward need as many on every rank (the base
    evens them out with fillers), and the packed step is the whole-batch step."""
    from gearshift.rl.algos import TOKENS_PER_SEQ, make_policy_loss_fn, tokens_per_seq
    from gearshift.train import TrainBatch

    rank = gdist.rank()
    g = torch.Generator().manual_seed(rank)
    n = 7 if rank == 0 else 1
    prompts = [torch.randint(32, 120, (3,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(32, 120, (int(k),), generator=g).tolist()
                 for k in torch.randint(1, 20, (n,), generator=g)]
    batch = TrainBatch.from_sequences(prompts, responses)
    batch.extras.update(advantages=torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask,
                        old_logprobs=-torch.rand(batch.loss_mask.shape, generator=g) * batch.loss_mask)
    batch.extras[TOKENS_PER_SEQ] = tokens_per_seq(batch.loss_mask)
    loss_fn = make_policy_loss_fn("ppo_clip")
    probe = fixed_batch()
    results = {}
    for name, args in (("whole", {}), ("packed", {"max_tokens_per_micro_batch": 30})):
        engine = build(gearshift_model, zero_stage=stage, lr=1e-3, max_grad_norm=None, **args)
        metrics = engine.train_step(batch, loss_fn)
        results[name] = (metrics, engine.forward_logprobs(probe).logprobs)
    (whole, whole_lp), (packed, packed_lp) = results["whole"], results["packed"]
    assert whole["micro_batches"] == 1 and packed["micro_batches"] >= 2
    assert packed["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert packed["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    diff = float((packed_lp - whole_lp)[probe.attention_mask.bool()].abs().max())
    print(f"FIGURE world={gdist.world_size()} zero_stage={stage}: packed vs whole-batch step, logprobs after: "
          f"max abs diff {diff:.3g}")
    assert diff <= 1e-4


def deepspeed_gathered(engine) -> dict[str, torch.Tensor]:
    """Every weight as DeepSpeed's `GatheredParameters` makes it whole (the export's path before it read the
    partitions), those a gather holds already (ZeRO-3's persistent small weights) as they are."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = {n: engine.trained[n] for n in engine.weight_spec().names()}
    unavailable = [p for p in params.values() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with deepspeed.zero.GatheredParameters(unavailable):
        return {n: p.detach().clone() for n, p in params.items()}


@contextmanager
def counting(monkeypatch, owner, name: str):
    """Counts the calls of `owner.name` while the context is open."""
    calls, real = [], getattr(owner, name)
    with monkeypatch.context() as patch:
        patch.setattr(owner, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
        yield calls


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_zero3_export_from_the_partitions_equals_deepspeeds_gather(odd_model, monkeypatch, param_dtype):
    """Before any forward (every parameter partitioned) and after a step (ZeRO-3 keeps the small ones gathered):
    one all-gather per bucket (none in one process), DeepSpeed's parameters left as they were, and buckets that
    stay valid while they are kept. The odd widths pad partitions; the tied head is the embedding once."""
    import deepspeed

    engine = build(odd_model, zero_stage=3, param_dtype=param_dtype)
    spec = engine.weight_spec()
    assert spec.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert any(p.ds_numel % 2 for p in engine.trained.values())  # padded partitions under two ranks
    bucket_bytes = spec.nbytes // 6  # buckets of several weights (runs of equal partition sizes), the embedding alone
    buckets = len(plan_reshard(spec, spec.replicated(), bucket_bytes).buckets)
    for step in range(2):
        if step:
            engine.train_step(fixed_batch(), nll)
        want = deepspeed_gathered(engine)
        status = [p.ds_status for p in engine.trained.values()]
        with counting(monkeypatch, torch.distributed, "all_gather_into_tensor") as gathers, \
                counting(monkeypatch, deepspeed.zero, "GatheredParameters") as deepspeeds:
            kept = list(export_weights(engine, bucket_bytes=bucket_bytes))  # every bucket held to the end
        got = {n: t for b in kept for n, t in b.items()}
        assert got.keys() == want.keys() and len(kept) == buckets >= 4
        assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want), step
        assert len(gathers) == (buckets if gdist.world_size() > 1 else 0) and not deepspeeds
        assert [p.ds_status for p in engine.trained.values()] == status
    engine.close()


def test_zero3_sync_from_the_partitions_gives_the_rollout_engine_deepspeeds_weights(odd_model, monkeypatch):
    """Into `hf` through the core's streaming resharder, after a step: the same weights, greedy generations and
    logprobs as a sync through DeepSpeed's `GatheredParameters` (forced by turning every bucket down)."""
    import deepspeed

    rollout = HFRolloutEngine.build(odd_model)
    before = {n: t.detach().clone() for n, t in rollout._params.items()}
    seen = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(gather, "refusal", lambda params, device: "forced: the comparison's baseline")
        engine = build(odd_model, zero_stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
        engine.train_step(fixed_batch(), nll)
        actor = HybridActor(engine, rollout)
        with counting(monkeypatch, deepspeed.zero, "GatheredParameters") as deepspeeds:
            actor.to_rollout()
        assert bool(deepspeeds) == forced
        out = actor.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
        seen.append(({n: t.detach().clone() for n, t in rollout._params.items()},
                     [(o.token_ids, o.logprobs) for o in out]))
        actor.to_train()
        engine.close()
    rollout.close()
    (weights, generated), (baseline, baseline_generated) = seen
    assert weights.keys() == baseline.keys() and all(torch.equal(weights[n], baseline[n]) for n in weights)
    assert any(not torch.equal(weights[n], before[n]) for n in weights)  # the step reached the rollout engine
    assert generated == baseline_generated


def test_zero3_stash_is_sized_before_the_first_step_and_kept_across_switches(gearshift_model):
    # ZeRO-3 with torch's AdamW: master weights and Adam's moments go to gearshift's stash, not DeepSpeed's move
    engine = build(gearshift_model, zero_stage=3)
    offloader = engine._offloader
    before = sorted(offloader.stash_sizes("optimizer", device_only=False))
    assert before and offloader.stash_sizes("optimizer") == []  # a CPU: nothing leaves a device
    assert engine.reserve_host(["optimizer", "grads"]) == 0  # so nothing to reserve
    batch = fixed_batch()
    engine.train_step(batch, nll)
    # the moments as the first step allocated them (Adam's step counters are host scalars: they stay)
    assert sorted(n for n in offloader.stash_sizes("optimizer", device_only=False) if n > 64) == before
    stashes = dict(offloader._stashes)
    for _ in range(2):
        engine.offload(["optimizer", "grads"])
        engine.onload()
    assert all(offloader._stashes[t] is stashes[t] for t in stashes)  # one host buffer a tag, every switch
    engine.close()


def test_reserving_runs_deepspeeds_own_move_once_so_its_pinned_buffers_exist_before_the_first_switch(
        gearshift_model, monkeypatch):
    """DeepSpeed pins the host buffers of the states it moves (ZeRO-3's gradient partitions) at its first
    `offload_states`: `reserve_host` runs that round trip at start, and the state comes back as it was."""
    engine = build(gearshift_model, zero_stage=3)
    engine.train_step(fixed_batch(), nll)
    def state():
        optimizer = engine.ds.optimizer
        return ([t.detach().clone() for t in optimizer.fp32_partitioned_groups_flat]
                + [p.ds_tensor.detach().clone() for p in engine.trained.values()])

    before = state()
    moves = []
    own = engine.ds.offload_states
    monkeypatch.setattr(engine.ds, "offload_states", lambda include, **kw: (moves.append(
        sorted(str(k.value) for k in include)), own(include=include, **kw))[1])
    engine.reserve_host(["optimizer", "grads"])
    assert moves == [["contiguous_grad_buffer", "lp_grads"]]  # torch's AdamW: the stash takes the optimizer's
    assert engine.offloaded() == []
    assert all(torch.equal(a, b) for a, b in zip(state(), before, strict=True))
    engine.train_step(fixed_batch(), nll)  # and training goes on
    engine.close()


@pytest.mark.parametrize("stage", STAGES)
def test_the_update_a_step_allocates_counts_zeros_master_partitions_and_adams_moments(gearshift_model, stage):
    """What the memory plan asks before a step (`step_bytes`): at stage 3 the weights are empty outside a gather,
    so the update is read from the master partitions DeepSpeed's optimizer steps, with Adam's two moments of them
    until the first step has made them; partitions in host memory (this CPU's, or ZeRO-Offload's) ask nothing."""
    from gearshift_deepspeed.sharding import update_bytes

    engine = build(gearshift_model, zero_stage=stage)
    try:
        masters = engine.sharding.master_partitions()
        trained = sum(math.prod(engine.sharding.full_shape(n, p)) for n, p in engine.trained.items())
        assert masters and all(t.dtype == torch.float32 for t in masters)
        assert sum(t.numel() for t in masters) >= trained / gdist.world_size()  # this rank's share of every weight
        sizes = [t.numel() * 4 for t in masters]
        assert not engine.sharding.stepped()
        assert update_bytes(sizes, stage, stepped=False) == 2 * sum(sizes) + (
            max(sizes) if stage == 3 else sum(sizes)) + max(sizes)
        assert engine.step_bytes()[1] == 0  # every partition in this CPU's memory: nothing on a device
        engine.train_step(fixed_batch(), nll)
        assert engine.sharding.stepped()
        assert update_bytes(sizes, stage, stepped=True) == update_bytes(sizes, stage, stepped=False) - 2 * sum(sizes)
    finally:
        engine.close()
