"""`ZeroSharding`: DeepSpeed ZeRO as the core's `Sharding` asks it of a trainer.

`deepspeed.initialize` wraps the model and a torch AdamW (or DeepSpeed's own);
DeepSpeed's engine runs backward (accumulating the micro-batches the base
weighs), the reduction, clipping, the global gradient norm and the step. At
stage 1 and 2 every rank holds every weight whole. At stage 3 the weights live
as flat partitions with no per-dimension layout: each is described as whole on
every rank (its shape kept in `ds_shape`) and gathered only around a bucket of
an export (`materialized`), so a rollout engine cannot serve from them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from gearshift.mesh import MeshSpec
from gearshift.sharding import Sharding
from torch import nn

from .config import deepspeed_config
from .runtime import import_deepspeed, initialize


class ZeroSharding(Sharding):
    """ZeRO stage 1, 2 or 3 over the dp ranks; `engine` is DeepSpeed's, once `parallelize` made it."""

    def __init__(self, *, zero_stage: int, compute_dtype: torch.dtype, lr: float, weight_decay: float,
                 betas: tuple[float, float], max_grad_norm: float | None, offload_params: bool = False,
                 offload_optimizer: bool = False, fused_optimizer: bool = False, overrides: dict | None = None) -> None:
        self.zero_stage = int(zero_stage)
        self.compute_dtype = compute_dtype
        self.lends_weights = self.zero_stage < 3  # ZeRO-3's weights exist whole only while gathered
        self.adamw = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas))
        self.max_grad_norm = max_grad_norm
        self.offload_params, self.offload_optimizer = offload_params, offload_optimizer
        self.fused_optimizer = fused_optimizer
        self.overrides = dict(overrides or {})
        self.engine = None

    def check(self, mesh: MeshSpec) -> None:
        if mesh.dp != mesh.world_size:
            raise ValueError(f"the deepspeed backend partitions over dp ranks only, but mesh {mesh} has "
                             f"tp/pp/sp > 1: use mesh dp={mesh.world_size}")

    def parallelize(self, model: nn.Module, hf_model: nn.Module, device: torch.device) -> nn.Module:
        trainable = [p for p in model.parameters() if p.requires_grad]
        config = deepspeed_config(
            zero_stage=self.zero_stage, max_grad_norm=self.max_grad_norm, compute_dtype=self.compute_dtype,
            offload_params=self.offload_params, offload_optimizer=self.offload_optimizer,
            pin_memory=device.type == "cuda", fused_optimizer=self.adamw if self.fused_optimizer else None,
            overrides=self.overrides,
        )
        optimizer = None if self.fused_optimizer else torch.optim.AdamW(trainable, **self.adamw)
        self.engine = initialize(model, optimizer, config)
        return self.engine

    def trained_parameters(self, model: nn.Module):
        return ((n, p) for n, p in model.module.named_parameters() if p.requires_grad)

    def full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        return tuple(getattr(param, "ds_shape", param.shape))  # stage 3 keeps an empty tensor beside it

    def optimizer(self, params, lr, weight_decay, betas) -> torch.optim.Optimizer:
        return self.engine.optimizer  # DeepSpeed's ZeRO optimizer around the AdamW given to it

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the base has weighed each micro-batch's loss already

    def clip_and_step(self, params, optimizer, max_grad_norm) -> float:
        """DeepSpeed reduces, clips to `max_grad_norm` and steps; the norm is before clipping, over all ranks."""
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def materialized(self, params) -> AbstractContextManager:
        """At stage 3, `params` gathered whole on every rank until the context closes; those a surrounding
        gather holds already are left be."""
        if self.zero_stage < 3:
            return nullcontext()
        deepspeed = import_deepspeed()
        unavailable = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE
        return deepspeed.zero.GatheredParameters([p for p in params if p.ds_status == unavailable])


__all__ = ["ZeroSharding"]
