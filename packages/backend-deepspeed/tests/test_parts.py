"""The pieces the engine is made of, each on its own, in one process."""

import sys

import pytest
import torch
from gearshift import registry
from gearshift.conformance.util import private_overrides
from gearshift.module_train import ModuleTrainEngine
from gearshift.sharding import Sharding

from gearshift_deepspeed.config import deepspeed_config, merge
from gearshift_deepspeed.engine import DeepSpeedTrainEngine, compute_dtype, one_rank_note
from gearshift_deepspeed.runtime import import_deepspeed
from gearshift_deepspeed.sharding import ZeroSharding


def test_registered_as_train_backend_deepspeed():
    assert registry.load("train", "deepspeed") is DeepSpeedTrainEngine


def test_built_on_the_core_through_public_names_only():
    assert private_overrides(DeepSpeedTrainEngine, ModuleTrainEngine) == []
    assert private_overrides(ZeroSharding, Sharding) == []


def test_zero3_on_one_gpu_says_what_it_costs_and_what_else_to_take():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert "zero_stage=1 or 2 trains the same" in one_rank_note(3, 1, gpu, offload_params=False)
    assert one_rank_note(3, 2, gpu, False) is None  # partitions over two ranks
    assert one_rank_note(2, 1, gpu, False) is None
    assert one_rank_note(3, 1, gpu, True) is None  # ZeRO-Offload of the weights needs stage 3
    assert one_rank_note(3, 1, cpu, False) is None  # the CPU tests run stage 3 on one rank throughout


def test_config_owns_accumulation_and_sets_clipping_explicitly():
    config = deepspeed_config(zero_stage=3, max_grad_norm=None, compute_dtype=torch.float32)
    assert config["managed_gradient_accumulation"] is False
    assert config["gradient_clipping"] == 0.0  # no clipping, not DeepSpeed's default of 1.0
    assert config["zero_optimization"] == {"stage": 3, "memory_efficient_linear": False}
    assert config["bf16"] == {"enabled": False} and "optimizer" not in config
    offload = deepspeed_config(zero_stage=3, max_grad_norm=1.0, compute_dtype=torch.bfloat16,
                               offload_params=True, offload_optimizer=True, pin_memory=True)
    assert offload["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert offload["zero_force_ds_cpu_optimizer"] is False  # ZeRO-Offload with torch's AdamW
    fused = deepspeed_config(zero_stage=2, max_grad_norm=1.0, compute_dtype=torch.float32,
                             offload_optimizer=True, fused_optimizer={"lr": 1e-3})
    assert fused["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3}} and "zero_force_ds_cpu_optimizer" not in fused
    with pytest.raises(ValueError, match="stages are 1, 2 and 3"):
        deepspeed_config(zero_stage=0, max_grad_norm=1.0, compute_dtype=torch.float32)


def test_merge_is_key_by_key_and_leaves_its_inputs_alone():
    base = {"a": {"b": 1, "c": 2}, "d": [1]}
    out = merge(base, {"a": {"c": 3}, "d": [2], "e": 4})
    assert out == {"a": {"b": 1, "c": 3}, "d": [2], "e": 4} and base == {"a": {"b": 1, "c": 2}, "d": [1]}


def test_compute_dtype_defaults_to_the_weights_dtype_on_a_cpu():
    cpu = torch.device("cpu")
    assert compute_dtype(None, torch.float32, cpu) == torch.float32
    assert compute_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert compute_dtype(None, torch.bfloat16, cpu) == torch.bfloat16


def test_the_shared_memory_op_is_not_built():
    import_deepspeed()
    assert sys.modules["deepspeed.comm.torch"].build_shm_op() is None
    assert not hasattr(torch, "build_shm_op")  # the module was patched, not the torch package it shadows


@pytest.mark.skipif("WORLD_SIZE" in __import__("os").environ, reason="takes down the process group of a plain process")
def test_an_engine_built_after_the_group_was_destroyed_elsewhere_trains(gearshift_model):
    """DeepSpeed keeps a clone of the world group; torch's own destroy (a test's teardown, a rollout engine
    closing the group) leaves it dead, and the next engine must not use it."""
    import torch.distributed as dist
    from gearshift.conformance.train import fixed_batch, nll

    losses = []
    for _ in range(2):
        engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3)
        losses.append(engine.train_step(fixed_batch(), nll)["loss"])
        engine.close()
        dist.destroy_process_group()
    assert losses[0] == losses[1]


@pytest.mark.skipif("WORLD_SIZE" in __import__("os").environ, reason="one process writes and reads the checkpoint")
def test_a_checkpoint_of_another_zero_stage_is_refused_naming_the_stage(gearshift_model, tmp_path):
    """DeepSpeed's own load of a stage-2 checkpoint into a stage-3 engine (or back) stops at a bare
    AssertionError; the engine says which stage wrote it and what to set."""
    from gearshift.conformance.train import fixed_batch, nll

    writer = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=2)
    writer.train_step(fixed_batch(), nll)
    writer.save(str(tmp_path / "ckpt"))
    writer.close()
    reader = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3)
    try:
        with pytest.raises(ValueError, match=r"saved at ZeRO stage 2 .*train\.options\.zero_stage=2"):
            reader.load(str(tmp_path / "ckpt"))
    finally:
        reader.close()


def test_compile_is_refused_before_deepspeed_starts_naming_fsdp(gearshift_model, monkeypatch):
    import gearshift_deepspeed.sharding as zero

    monkeypatch.setattr(zero, "initialize", lambda *a, **k: pytest.fail("DeepSpeed started"))
    with pytest.raises(ValueError, match="train.options.compile.*use train.backend=fsdp"):
        DeepSpeedTrainEngine.build(gearshift_model, compile=True)
