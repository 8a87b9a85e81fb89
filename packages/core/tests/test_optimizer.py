"""The default optimizer's implementation: fused AdamW on plain CUDA tensors, torch's default elsewhere."""

from types import SimpleNamespace

import torch
from gearshift.sharding import Sharding, adamw_kernel
import torch.distributed.tensor


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
