"""The default optimizer's implementation: fused AdamW on plain CUDA tensors, torch's default elsewhere."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed.tensor
from gearshift.module_train import ModuleTrainEngine
from gearshift.sharding import Sharding, adam_state_sizes, adamw_kernel


def _on(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_fused_only_where_every_parameter_is_a_plain_cuda_tensor():
    assert adamw_kernel([_on("cuda"), _on("cuda:1")]) == {"fused": True}
    assert adamw_kernel([_on("cuda"), _on("cpu")]) == {}
    assert adamw_kernel([_on("cpu")]) == {}
    assert adamw_kernel([]) == {}


def test_dtensor_shards_keep_the_default(monkeypatch):
    class Shard:  # stands for a DTensor on a GPU: the check is an instance check and the device
        device = torch.device("cuda")

    monkeypatch.setattr(torch.distributed.tensor, "DTensor", Shard)
    assert adamw_kernel([Shard()]) == {}
    assert adamw_kernel([_on("cuda")]) == {"fused": True}


def test_the_default_optimizer_on_a_cpu_is_torchs_default_adamw():
    p = torch.nn.Parameter(torch.ones(3))
    opt = Sharding().optimizer([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.999))
    assert isinstance(opt, torch.optim.AdamW)
    assert not opt.defaults["fused"]
    p.grad = torch.ones(3)
    opt.step()
    assert torch.all(p < 1)


@pytest.mark.parametrize("fused", [False, True])
def test_adam_state_sizes_are_the_storages_adamw_makes_at_its_first_step(fused):
    """What the memory plan reserves host memory for before the first step: one storage more or less and the
    first offload outgrows the reserved buffer and pins a new one, the slow first switch it exists to prevent."""
    params = [torch.nn.Parameter(torch.randn(3, 5, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # on a GPU foreach AdamW's step counts stay on the host (the plan counts device storages only): here, on a
    # CPU, they are the 0-dim tensors of the unfused state
    made = [t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
            if torch.is_tensor(t) and (fused or t.dim() > 0)]
    assert sorted(made) == sorted(adam_state_sizes(params, fused=fused))


@pytest.mark.parametrize("fused", [None, False, True])
def test_the_plan_sizes_the_first_step_of_any_optimizer(fused):
    """Before the first step on a GPU, `ModuleTrainEngine` sizes the optimizer's state from its parameters: with
    torch's AdamW fused or not, and with an optimizer that has no `defaults` (DeepSpeed's ZeRO optimizers)."""
    p = torch.nn.Parameter(torch.zeros(4, 2))
    optimizer = SimpleNamespace(state={}, param_groups=[{"params": [p]}])
    if fused is not None:
        optimizer.defaults = {"fused": fused}
    engine = SimpleNamespace(optimizer=optimizer, device=torch.device("cuda"), sharding=Sharding())
    sizes = ModuleTrainEngine._storage_sizes(engine, "optimizer")
    assert sizes == ([32, 32, 4] if fused else [32, 32])
