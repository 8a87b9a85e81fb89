"""`FSDPSharding`: how the fsdp trainer lays a causal LM over the mesh, as the core's `Sharding` asks it.

On a mesh of one rank with nothing for FSDP to do (no cast to a lower `param_dtype`, no `cpu_offload`), the
module trains as it is (`plain`: the core's own one-process `Sharding`), without FSDP2's per-micro-batch
copies of the weights and gradients; `one_rank="fsdp"` wraps it all the same.

FSDP2's `fully_shard` over the dp ranks (hybrid replicate x shard with
`replicate > 1`), after the model's own tensor-parallel plan with tp > 1 and
with Ulysses attention with sp > 1. Each weight is a DTensor: its placement
is read from it (`placement_of`), its local shard is `to_local()`, its whole
shape its own. With tp or sp, the gradient norm and clipping run over the
DTensor shards (`clip_by_norm`) after the partial tp gradients are summed.
"""

from __future__ import annotations

import torch
from gearshift.mesh import MeshSpec, Placement
from gearshift.sharding import Sharding
from gearshift.train import PolicyOutput, TrainBatch
from torch import nn
from torch.distributed.tensor import DTensor

from . import sequence_parallel as ulysses
from .grads import clip_by_norm, sum_partial_grads
from .parallelize import build_device_mesh, build_dp_mesh, fsdp_mesh, parallelize_causal_lm, reshard
from .placement import placement_of


class FSDPSharding(Sharding):
    """FSDP2 over dp (or dp x sp), beside tensor parallelism over tp; the knobs are the fsdp options'."""

    def __init__(self, mesh: MeshSpec, *, master_dtype: torch.dtype, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype, replicate: int = 1, reshard_after_forward: bool | int = True,
                 cpu_offload: bool = False, one_rank: str = "auto") -> None:
        self.mesh = mesh
        self.replicate = int(replicate)
        self.master_dtype, self.param_dtype, self.reduce_dtype = master_dtype, param_dtype, reduce_dtype
        self.compute_dtype = param_dtype or master_dtype
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        #: parameters whose gradients each tp rank computes only in part (summed over tp after backward)
        self.partial_grads: list[nn.Parameter] = []
        self.world_mesh = self.device_mesh = None
        if one_rank not in ("auto", "plain", "fsdp"):
            raise ValueError(f"one_rank must be 'auto', 'plain' or 'fsdp', not {one_rank!r}")
        casts = param_dtype is not None and param_dtype != master_dtype
        if one_rank == "plain" and (casts or cpu_offload) and mesh.world_size == 1:
            raise ValueError(f"one_rank='plain' trains the module as it is, with no cast to param_dtype "
                             f"{param_dtype} and no cpu_offload: use one_rank='fsdp' (or 'auto'), or master "
                             f"weights in the compute dtype")
        #: one rank trains the module as it is: nothing to shard, nothing for FSDP to cast or offload
        self.plain = mesh.world_size == 1 and self.replicate == 1 and (
            one_rank == "plain" or (one_rank == "auto" and not casts and not cpu_offload))

    @property
    def plain_dp(self) -> bool:
        return self.mesh.tp == 1 and self.mesh.sp == 1

    def compile(self, model: nn.Module, mesh: MeshSpec) -> None:
        if not self.plain_dp:  # tp's DTensor layers and sp's attention collectives inside a layer: not measured
            raise ValueError(f"train.options.compile compiles the layers of a data-parallel mesh; mesh {mesh} has "
                             f"tp={mesh.tp}, sp={mesh.sp}: leave compile off there")
        super().compile(model, mesh)

    def check(self, mesh: MeshSpec) -> None:
        if mesh.pp != 1:
            raise ValueError(f"the fsdp backend has no pipeline parallelism, but mesh {mesh} has "
                             f"pp={mesh.pp}: use dp, tp and sp (for example dp={mesh.world_size})")
        if self.replicate > 1 and (mesh.tp > 1 or mesh.sp > 1):
            raise ValueError(f"hybrid sharding (replicate={self.replicate}) runs over dp alone, but mesh "
                             f"{mesh} has tp or sp > 1: use replicate=1 with tp or sp")
        if self.replicate < 1 or mesh.dp % self.replicate:
            raise ValueError(f"replicate={self.replicate} must divide dp={mesh.dp}")

    def parallelize(self, model: nn.Module, hf_model: nn.Module, device: torch.device) -> nn.Module:
        if self.plain:
            return super().parallelize(model, hf_model, device)
        partial: list[str] = []
        if self.plain_dp:
            self.device_mesh = build_dp_mesh(self.mesh, device.type, self.replicate)
        else:
            self.world_mesh = build_device_mesh(self.mesh, device.type)
            self.device_mesh = fsdp_mesh(self.world_mesh)
            if self.mesh.sp > 1:
                ulysses.check_heads(hf_model.config, sp=self.mesh.sp, tp=self.mesh.tp)
                ulysses.use_ulysses_attention(hf_model, self.world_mesh["sp"].get_group())
            if self.mesh.tp > 1:
                from gearshift.tensor_parallel import parallelize_tensor

                partial = list(parallelize_tensor(model, hf_model, self.world_mesh["tp"]).partial_grads)
        sharded = parallelize_causal_lm(
            model,
            mesh=self.device_mesh,
            param_dtype=None if self.param_dtype == self.master_dtype else self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            # sequence-parallel ranks each hold a part of the same sequences: their gradients add up
            gradient_divide_factor=float(self.mesh.dp) if self.mesh.sp > 1 else None,
        )
        named = dict(sharded.named_parameters())
        self.partial_grads = [named[n] for n in partial]
        return sharded

    def placement(self, name: str, param: torch.Tensor, mesh: MeshSpec) -> Placement:
        return super().placement(name, param, mesh) if self.plain else placement_of(param, mesh)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    @property
    def shares_prompts(self) -> bool:
        return self.mesh.sp == 1  # Ulysses splits the sequence: a packed prompt's mask would cross its ranks

    def forward(self, model: nn.Module, batch: TrainBatch, with_entropy: bool, value_head: bool,
                layout=None, mask_kind: str = "bool") -> PolicyOutput:
        if self.mesh.sp == 1:
            return super().forward(model, batch, with_entropy, value_head, layout=layout, mask_kind=mask_kind)
        return ulysses.forward(model, batch, self.world_mesh["sp"], with_entropy, value_head=value_head)

    def clip_and_step(self, params, optimizer, max_grad_norm) -> float:
        if self.plain_dp:
            return super().clip_and_step(params, optimizer, max_grad_norm)
        if self.partial_grads:
            sum_partial_grads(self.partial_grads, self.world_mesh["tp"].get_group())
        norm = clip_by_norm(list(params), max_grad_norm)
        optimizer.step()
        return norm

    def release(self, model: nn.Module) -> None:
        reshard(model)  # else the root's weights stay gathered (for a backward that is not coming)


__all__ = ["FSDPSharding"]
