"""The engine's options: each trains like the default, makes the documented difference, or is refused clearly.

Runs in one process here and with two under torchrun (test_two_processes.py).
"""

import os

import pytest
import torch
from gearshift import dist as gdist
from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll
from gearshift.mesh import MeshSpec
from gearshift.module_train import position_ids
from gearshift.options import OptionError
from gearshift.train import token_logprobs

from gearshift_deepspeed.engine import DeepSpeedTrainEngine


def build(model, **options):
    return DeepSpeedTrainEngine.build(model, **{"lr": 1e-2, "param_dtype": "float32", **options})


def trained(engine, steps: int = 2):
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(steps)]
    return losses, full_weights(engine)


@pytest.fixture(scope="module")
def reference(gearshift_model):
    return {stage: trained(build(gearshift_model, zero_stage=stage)) for stage in (2, 3)}


@pytest.mark.parametrize("stage,options,exact", [
    (2, {"offload_optimizer": True}, True),
    (3, {"offload_optimizer": True}, False),
    (3, {"offload_params": True}, True),
    (3, {"offload_params": True, "offload_optimizer": True}, False),
    (3, {"gradient_checkpointing": True}, True),
    (2, {"config": {"zero_optimization": {"reduce_bucket_size": 4096}}}, True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) if isinstance(o, dict) else str(o))
def test_option_trains_like_the_default(gearshift_model, reference, stage, options, exact):
    """DeepSpeed's ZeRO-Offload keeps the state in host memory (the step runs on the CPU); at stage 3 its
    offloaded optimizer clips in another order than the device path, a rounding apart."""
    losses, weights = trained(build(gearshift_model, zero_stage=stage, **options))
    ref_losses, ref_weights = reference[stage]
    if exact:
        assert losses == ref_losses
        assert_same(weights, ref_weights)
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for name in weights:
            torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=1e-5, msg=name)


def test_config_overrides_reach_deepspeed(gearshift_model):
    engine = build(gearshift_model, zero_stage=2, max_grad_norm=0.5,
                   config={"zero_optimization": {"reduce_bucket_size": 4096}, "steps_per_print": 7})
    assert engine.ds.gradient_clipping() == 0.5  # set from max_grad_norm, not DeepSpeed's default of 1.0
    assert engine.ds.zero_reduce_bucket_size() == 4096 and engine.ds.steps_per_print() == 7
    assert engine.ds.zero_optimization_stage() == 2  # keys not overridden stay the engine's
    assert build(gearshift_model, max_grad_norm=None).ds.gradient_clipping() == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_bfloat16_compute_keeps_float32_master_weights(gearshift_model, stage):
    from transformers import AutoModelForCausalLM

    engine = build(gearshift_model, zero_stage=stage, param_dtype="bfloat16")
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
    assert float((got - want)[mask].abs().max()) <= 1e-5  # computes as the model does in bf16
    assert float((got - exact)[mask].abs().max()) > 1e-4  # ... which is not fp32
    assert {p.dtype for p in engine.weight_spec()} == {torch.bfloat16}  # what forward reads, and exports
    masters = engine._offloader._tensors("hp_params")
    assert masters and all(t.dtype == torch.float32 for t in masters)
    assert losses[-1] < losses[0] and all(w.dtype == torch.bfloat16 for w in weights.values())


def test_bad_options_are_refused_with_a_clear_error(gearshift_model):
    with pytest.raises(OptionError, match="zero_stage"):
        build(gearshift_model, zero_stage=4)
    with pytest.raises(ValueError, match="offload_params needs zero_stage=3"):
        build(gearshift_model, zero_stage=2, offload_params=True)
    with pytest.raises(ValueError, match="float16"):
        build(gearshift_model, param_dtype="float16")
    with pytest.raises(ValueError, match="cannot compute in"):
        build(gearshift_model, dtype="bfloat16", param_dtype="float32")
    if gdist.world_size() > 1:
        with pytest.raises(ValueError, match="dp ranks only"):
            build(gearshift_model, mesh=MeshSpec(tp=gdist.world_size()))


def handoff(model, prefix: str = "", **options) -> None:
    """Resume the `{prefix}ckpt` the launcher wrote in one process, then write one that it resumes."""
    folder = os.environ.get("GEARSHIFT_DEEPSPEED_HANDOFF")
    if not folder:
        pytest.skip("the launcher of the two-process run sets GEARSHIFT_DEEPSPEED_HANDOFF")
    written_by_one = torch.load(os.path.join(folder, "one", f"{prefix}expected.pt"), weights_only=True)
    engine = build(model, **options)
    engine.load(os.path.join(folder, "one", f"{prefix}ckpt"))
    assert_same(full_weights(engine), written_by_one["weights"])
    assert engine.train_step(fixed_batch(), nll)["loss"] == pytest.approx(written_by_one["next_loss"], rel=1e-6)

    engine = build(model, **options)
    engine.train_step(fixed_batch(), nll)
    engine.save(os.path.join(folder, "two", f"{prefix}ckpt"))
    weights = full_weights(engine)
    loss = engine.train_step(fixed_batch(), nll)["loss"]
    if gdist.rank() == 0:
        torch.save({"weights": weights, "next_loss": loss}, os.path.join(folder, "two", f"{prefix}expected.pt"))
    gdist.barrier()


def test_checkpoint_for_another_dp_size(gearshift_model):
    """Under torchrun: resume the checkpoint the launcher wrote in one process, and write one it resumes."""
    handoff(gearshift_model)


def test_lora_checkpoint_for_another_dp_size(gearshift_model):
    """Under torchrun: the same with LoRA, whose checkpoints hold the adapters only (the base is the model)."""
    handoff(gearshift_model, "lora-", lora_r=4, lora_alpha=8)
