"""The engine's options: each trains exactly like the default, or makes the documented difference.

Runs in one process here and with two under torchrun (test_two_processes.py).
"""

import json
import os

import pytest
import torch
from gearshift import dist as gdist
from gearshift.module_train import position_ids
from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll
from gearshift.mesh import MeshSpec
from gearshift.train import token_logprobs

from gearshift_fsdp.engine import FSDPTrainEngine
from gearshift_fsdp.placement import HybridShard


#: set by a launcher: the mesh (tp, sp) or hybrid sharding every engine here is built with
LAUNCH = json.loads(os.environ.get("GEARSHIFT_FSDP_OPTIONS", "{}"))
PLAIN_DP = "mesh" not in LAUNCH


def build(model, **options):
    # the tests read the last step's gradients, which the engine otherwise frees after its optimizer step; on
    # one rank FSDP2 is asked for (`one_rank`), whose DTensors these tests read
    return FSDPTrainEngine.build(model, **{"lr": 1e-2, "param_dtype": "float32", "mesh": LAUNCH.get("mesh"),
                                           "keep_grads": True, "one_rank": "fsdp", **options})


def trained(engine, steps: int = 2):
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(steps)]
    return losses, full_weights(engine)


@pytest.fixture(scope="module")
def reference(gearshift_model):
    return trained(build(gearshift_model))


@pytest.mark.parametrize("options", [
    {"reshard_after_forward": False},
    {"cpu_offload": True},
    {"gradient_checkpointing": True},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_option_trains_exactly_like_the_default(gearshift_model, reference, options):
    losses, weights = trained(build(gearshift_model, **options))
    assert losses == reference[0]
    assert_same(weights, reference[1])


def test_micro_batches_accumulate_to_the_same_step(gearshift_model):
    def per_sequence_nll(out, batch):  # a mean over sequences: micro-batches weigh in by their sequences
        return -(out.logprobs * batch.loss_mask).sum() / batch.size, {}

    results = []
    for size in (None, 1):
        engine = build(gearshift_model, micro_batch_size=size)
        loss = engine.train_step(fixed_batch(), per_sequence_nll)["loss"]
        results.append((loss, {n: p.grad.full_tensor() for n, p in engine.trained.items()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)  # the same sums, added in another order
    assert_same(results[1][1], results[0][1], exact=False)


@pytest.mark.skipif(gdist.world_size() < 4 or gdist.world_size() % 2,
                    reason="resharding to a smaller group needs a divisor of the dp size other than 1 and itself")
def test_reshard_after_forward_to_a_smaller_group(gearshift_model, reference):
    losses, weights = trained(build(gearshift_model, reshard_after_forward=2))
    assert losses == reference[0]
    assert_same(weights, reference[1])


def test_cpu_offload_keeps_the_state_in_host_memory(gearshift_model):
    engine = build(gearshift_model, cpu_offload=True)
    engine.train_step(fixed_batch(), nll)
    assert all(t.device.type == "cpu" for tag in ("params", "grads", "optimizer") for t in engine.state_tensors(tag))
    assert engine.offload() == 0 and engine.onload() == 0  # already in host memory: nothing to move


@pytest.mark.skipif(gdist.world_size() % 2 or not PLAIN_DP,
                    reason="hybrid sharding needs an even number of ranks, over dp alone")
def test_hybrid_sharding_trains_exactly_like_plain_sharding(gearshift_model, reference):
    engine = build(gearshift_model, replicate=2)
    spec, rank = engine.weight_spec(), gdist.rank()
    local = engine.local_weights(spec.names())
    losses, weights = trained(engine)
    assert engine.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert all(isinstance(p.placement, HybridShard) and p.placement.replicate == 2 for p in spec)
    assert all(tuple(local[p.name].shape) == p.placement.local_shape(p.shape, rank) for p in spec)
    # the same sums, split differently over the ranks (the norm, the optimizer's vector ops): equal to rounding
    assert losses == pytest.approx(reference[0], rel=1e-6)
    assert_same(weights, reference[1], exact=False)


def test_bfloat16_compute_keeps_float32_master_weights(gearshift_model):
    from transformers import AutoModelForCausalLM

    engine = build(gearshift_model, param_dtype="bfloat16")
    batch = fixed_batch()
    got = engine.forward_logprobs(batch).logprobs
    hf = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.bfloat16)
    fp32 = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.float32)
    with torch.no_grad():
        want, exact = (token_logprobs(m(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                        position_ids=position_ids(batch.attention_mask)).logits,
                                      batch.input_ids).logprobs for m in (hf, fp32))
    losses, weights = trained(engine, steps=3)
    mask = batch.attention_mask.bool()
    # computes as the model does in bf16; tensor parallelism adds up the partial sums of its rows in bf16 too,
    # which rounds once more than one matmul does
    assert float((got - want)[mask].abs().max()) <= (1e-5 if "tp" not in str(LAUNCH.get("mesh")) else 1e-2)
    assert float((got - exact)[mask].abs().max()) > 1e-4  # ... which is not fp32
    assert {p.dtype for p in engine.weight_spec()} == {torch.float32}
    assert losses[-1] < losses[0] and all(w.dtype == torch.float32 for w in weights.values())
    assert all(t.dtype == torch.float32 for t in engine.state_tensors("grads"))  # reduced in fp32


def grad_norm(engine) -> float:
    """The global gradient norm, computed from the gathered gradients."""
    grads = [p.grad.full_tensor() for p in engine.trained.values() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]).double()))  # float64: exact enough


def test_clipping_uses_the_norm_over_all_shards(gearshift_model):
    free, clipped = build(gearshift_model, max_grad_norm=None), build(gearshift_model, max_grad_norm=1e-3)
    reported = free.train_step(fixed_batch(), nll)["grad_norm"]
    reported_clipped = clipped.train_step(fixed_batch(), nll)["grad_norm"]
    norms = grad_norm(free), grad_norm(clipped)
    assert reported == pytest.approx(norms[0], rel=1e-5)
    assert reported_clipped == pytest.approx(reported, rel=1e-6)  # the norm before clipping
    assert norms[1] == pytest.approx(1e-3, rel=1e-3)


def test_metrics_are_the_same_on_every_rank(gearshift_model):
    import torch.distributed as dist

    metrics = build(gearshift_model).train_step(fixed_batch(), nll)
    everyone = [None] * gdist.world_size()
    dist.all_gather_object(everyone, metrics)
    assert all(m == metrics for m in everyone)


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
    assert min(losses[1:]) < losses[0]  # the best after stepping: at this lr a wider model overshoots once
    lm = AutoModelForCausalLM.from_pretrained(str(gearshift_shared_tmp / "critic"), dtype=torch.float32)
    theirs = dict(lm.named_parameters())
    assert_same({k[len("lm."):]: v for k, v in weights.items() if k.startswith("lm.")},
                {k: theirs[k].detach() for k in theirs})
    head = load_file(str(gearshift_shared_tmp / "critic" / "value_head.safetensors"))
    assert_same({f"value_head.{k}": v for k, v in head.items()},
                {k: v for k, v in weights.items() if k.startswith("value_head.")})


def test_bad_layouts_are_refused_with_a_clear_error(gearshift_model):
    from transformers import AutoConfig

    world = gdist.world_size()
    with pytest.raises(ValueError, match="replicate=3 must divide"):
        build(gearshift_model, replicate=3, mesh=None)
    if world > 1:
        with pytest.raises(ValueError, match="no pipeline parallelism"):
            build(gearshift_model, mesh=MeshSpec(pp=world))
        with pytest.raises(ValueError, match="hybrid sharding .* runs over dp alone"):
            build(gearshift_model, mesh=MeshSpec(tp=world), replicate=2)
        heads = AutoConfig.from_pretrained(gearshift_model).num_key_value_heads
        if heads % world:  # whole heads per rank, or a clear error naming the model's head count
            for axis in ("tp", "sp"):
                with pytest.raises(ValueError, match=f"{axis}={world} .*must divide the model's num_"):
                    build(gearshift_model, mesh=MeshSpec(**{axis: world}))


def test_checkpoint_for_another_dp_size(gearshift_model):
    """Under torchrun: write a checkpoint that test_two_processes.py resumes in one process."""
    folder = os.environ.get("GEARSHIFT_FSDP_HANDOFF")
    if not folder:
        pytest.skip("the launcher of the two-process run sets GEARSHIFT_FSDP_HANDOFF")
    engine = build(gearshift_model)
    engine.train_step(fixed_batch(), nll)
    engine.save(os.path.join(folder, "ckpt"))
    weights = full_weights(engine)
    loss = engine.train_step(fixed_batch(), nll)["loss"]
    if gdist.rank() == 0:
        torch.save({"weights": weights, "next_loss": loss}, os.path.join(folder, "expected.pt"))
    gdist.barrier()


@pytest.mark.skipif(gdist.world_size() > 1, reason="one rank only")
def test_one_rank_trains_the_module_as_it_is_exactly_like_fsdp(gearshift_model, reference):
    from gearshift_fsdp.parallelize import FSDPModule

    engine = build(gearshift_model, one_rank="auto")
    assert engine.plain and engine.device_mesh is None
    assert not any(isinstance(m, FSDPModule) for m in engine.model.modules())
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in engine.trained.values())
    assert all(p.placement.is_replicated() for p in engine.weight_spec())
    losses, weights = trained(engine)
    assert losses == pytest.approx(reference[0], rel=1e-6)  # the same sums; FSDP reduces in its own order
    assert_same(weights, reference[1], exact=False)


@pytest.mark.skipif(gdist.world_size() > 1, reason="one rank only")
def test_one_rank_keeps_fsdp_where_it_casts_or_offloads_and_plain_says_why_it_cannot(gearshift_model):
    assert not build(gearshift_model, one_rank="auto", param_dtype="bfloat16").plain  # FSDP casts the weights
    assert not build(gearshift_model, one_rank="auto", cpu_offload=True).plain
    assert build(gearshift_model, one_rank="plain").plain
    with pytest.raises(ValueError, match="one_rank='plain' trains the module as it is.*use one_rank='fsdp'"):
        build(gearshift_model, one_rank="plain", param_dtype="bfloat16")


def test_compiled_layers_train_like_the_uncompiled_ones_and_tp_or_sp_refuse_them(gearshift_model, tmp_path,
                                                                                 monkeypatch):
    """`compile`: each layer's forward compiled, under FSDP2's hooks (its unsharding stays outside the compiled
    code); a mesh with tp or sp, whose collectives run inside a layer, refuses it."""
    if not PLAIN_DP:
        with pytest.raises(ValueError, match="compiles the layers of a data-parallel mesh"):
            build(gearshift_model, compile=True)
        return
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    from gearshift.layers import decoder_layers

    eager, compiled = build(gearshift_model), build(gearshift_model, compile=True)
    assert all(getattr(layer.forward, "_gearshift_compiled", False) for layer in decoder_layers(compiled.model))
    losses = [e.train_step(fixed_batch(), nll)["loss"] for e in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)

    def grads(engine):  # whole gradients (Adam's update magnifies float rounding where a gradient is near 0)
        return {n: getattr(p.grad, "full_tensor", lambda: p.grad)() for n, p in engine.trained.items()}

    want, got = grads(eager), grads(compiled)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
