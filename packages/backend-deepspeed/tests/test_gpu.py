"""On a CUDA device (skipped without one): bf16 compute by default, offload that frees device memory, export memory.

tools/gpu/deepspeed_h200.sh tests runs these on the lent H200.
"""

import pytest
import torch
from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll
from gearshift.reshard import export_weights

from gearshift_deepspeed.engine import DeepSpeedTrainEngine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stage", [2, 3])
def test_defaults_on_a_gpu(gearshift_model, stage):
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage)
    assert engine.device.type == "cuda" and engine.ds.device.type == "cuda"
    bf16 = torch.cuda.is_bf16_supported()
    assert engine.compute_dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert {p.dtype for p in engine.weight_spec()} == {engine.compute_dtype}  # what forward reads, and exports
    assert all(t.dtype == torch.float32 for t in engine._offloader._tensors("hp_params"))  # fp32 master weights
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_frees_device_memory_and_onload_restores_it_bit_exactly(gearshift_model, stage):
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage)
    twin = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage)
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    before = full_weights(engine)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = engine.offload(["optimizer", "grads"]) + engine.offload(["params"])
    optimizer_bytes = sum(t.numel() * t.element_size() for k in ("hp_params", "optim_states")
                          for t in engine._offloader._tensors(k))
    assert moved >= optimizer_bytes > 0  # at least the fp32 master weights and Adam's moments left
    assert torch.cuda.memory_allocated() <= held - moved
    if stage == 3:  # DeepSpeed moves these only for its FusedAdam: the engine's stash holds them, pinned
        stash = engine._offloader._stashes["optimizer"]
        assert len(stash) and stash.pinned
    with pytest.raises(RuntimeError, match="onload"):
        engine.forward_logprobs(fixed_batch())
    assert engine.onload(["params", "grads", "optimizer"]) >= 0.9 * moved
    assert_same(full_weights(engine), before)
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    assert_same(full_weights(engine), full_weights(twin))


def test_zero3_export_peak_device_memory_is_about_one_bucket(gearshift_model):
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, param_dtype="float32")
    spec = engine.weight_spec()
    bucket_bytes = max(p.nbytes for p in spec)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in export_weights(engine, bucket_bytes=bucket_bytes):
        pass
    peak = torch.cuda.max_memory_allocated() - base
    # the loop variable holds the previous bucket while the next is gathered, plus DeepSpeed's staging
    assert peak <= 3 * bucket_bytes + 2**20, f"export peaked at {peak} bytes for buckets of {bucket_bytes}"
    assert peak < spec.nbytes


@pytest.mark.slow
def test_fused_optimizer_lets_deepspeed_offload_every_zero3_state(gearshift_model):
    """DeepSpeed's FusedAdam is compiled with nvcc on first use (tens of seconds); with it, offload_states
    moves the fp32 master weights and Adam's moments itself."""
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, fused_optimizer=True)
    twin = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, fused_optimizer=True)
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    assert engine.offload() > 0
    assert {"hp_params", "optim_states", "lp_params"} <= {s.value for s in engine.ds.optimizer.offloaded_states}
    assert not any(len(s) for s in engine._offloader._stashes.values())
    engine.onload()
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    assert_same(full_weights(engine), full_weights(twin))
