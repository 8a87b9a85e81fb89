"""On a CUDA device (skipped without one): nccl, bf16 compute by default, offload that frees device memory."""

import pytest
import torch
from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll
from gearshift.reshard import export_weights

from gearshift_fsdp.engine import FSDPTrainEngine

pytestmark = pytest.mark.gpu


def test_defaults_on_a_gpu(gearshift_model):
    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2)
    assert engine.device.type == "cuda"
    assert engine.param_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)
    assert {p.dtype for p in engine.weight_spec()} == {torch.float32}  # fp32 master weights
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]


def test_offload_frees_device_memory_and_onload_restores_it_bit_exactly(gearshift_model):
    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2)
    twin = FSDPTrainEngine.build(gearshift_model, lr=1e-2)
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    before = full_weights(engine)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = engine.offload(["params", "grads", "optimizer"])
    assert moved > 0
    assert torch.cuda.memory_allocated() <= held - moved  # every offloaded byte left the device
    held_host = [stash for stash in engine._stashes.values() if len(stash)]
    assert held_host and all(stash.pinned for stash in held_host)
    assert sum(s.host_bytes for s in held_host) <= 1.05 * moved  # pinned exactly what was moved
    with pytest.raises(RuntimeError, match="onload"):
        engine.forward_logprobs(fixed_batch())
    assert engine.onload(["params", "grads", "optimizer"]) == moved
    assert_same(full_weights(engine), before)
    for e in (engine, twin):
        e.train_step(fixed_batch(), nll)
    assert_same(full_weights(engine), full_weights(twin))


def test_cpu_offload_trains_like_the_default(gearshift_model):
    results = []
    for options in ({}, {"cpu_offload": True}):
        engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32", **options)
        results.append([engine.train_step(fixed_batch(), nll)["loss"] for _ in range(2)])
    assert results[1] == pytest.approx(results[0], rel=1e-5)


def test_export_peak_device_memory_is_one_bucket(gearshift_model):
    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32")
    spec = engine.weight_spec()
    bucket_bytes = max(p.nbytes for p in spec)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in export_weights(engine, bucket_bytes=bucket_bytes):
        pass
    peak = torch.cuda.max_memory_allocated() - base
    # the loop variable holds the previous bucket while the next is built: two buckets, and receive buffers
    assert peak <= 3 * bucket_bytes + 2**20, f"export peaked at {peak} bytes for buckets of {bucket_bytes}"
