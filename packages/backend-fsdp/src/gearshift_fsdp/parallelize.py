"""Applying FSDP2 (and tensor parallelism) to a Hugging Face causal LM: the one place that decides how the
model is sharded.

The torchtitan pattern: the model's tensor-parallel plan is applied first, on the
`tp` dimension of one device mesh over every rank, then FSDP shards what each
rank holds over the rest: `dp`, or `dp` x `sp` flattened into one dimension
(sequence-parallel peers hold the same weights, so FSDP may as well shard them
over those ranks too).
"""

from __future__ import annotations

import torch
from gearshift.layers import decoder_layers
from gearshift.mesh import MeshError, MeshSpec
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def build_dp_mesh(mesh: MeshSpec, device_type: str, replicate: int = 1) -> DeviceMesh:
    """The FSDP mesh over `mesh`'s dp ranks: 1-D `dp`, or 2-D (`dp_replicate`, `dp_shard`) for hybrid sharding."""
    if replicate < 1 or mesh.dp % replicate:
        raise MeshError(f"replicate={replicate} must divide dp={mesh.dp}: hybrid sharding makes "
                        f"{replicate} groups of dp/replicate ranks, each holding one sharded copy")
    if replicate == 1:
        return mesh.to_device_mesh(device_type, axes=("dp",))
    return init_device_mesh(device_type, (replicate, mesh.dp // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))


def build_device_mesh(mesh: MeshSpec, device_type: str) -> DeviceMesh:
    """One device mesh over every rank, dimensions (`dp`, `sp`, `tp`) in the core's rank order (size 1 kept)."""
    if mesh.pp != 1:
        raise MeshError(f"the fsdp backend has no pipeline parallelism: mesh {mesh} has pp={mesh.pp}; use pp=1")
    return init_device_mesh(device_type, (mesh.dp, mesh.sp, mesh.tp), mesh_dim_names=("dp", "sp", "tp"))


def fsdp_mesh(world: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: `dp`, or `dp` x `sp` flattened (named `dp_sp`) when sp > 1."""
    if world["sp"].size() == 1:
        return world["dp"]
    return world["dp", "sp"]._flatten("dp_sp")


def parallelize_causal_lm(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard each decoder layer, then the root, over `mesh`; returns the model, sharded in place.

    The root group holds what the layers do not: the embeddings, the final norm and
    the output head, so a head tied to the embeddings stays one parameter. The
    root keeps its parameters gathered between forward and backward (FSDP's own
    choice for the root: backward needs them first). `param_dtype` and
    `reduce_dtype` set the compute and gradient-reduction dtypes (None: the
    parameters' own); `cpu_offload` keeps the sharded state in host memory and
    runs the optimizer there. `gradient_divide_factor` replaces FSDP's mean over the mesh
    (sequence parallelism sums its ranks' gradients and averages over dp only).
    """
    layers = decoder_layers(model, to="shard")
    options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy(),
    )
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    if gradient_divide_factor is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(gradient_divide_factor)
                module.set_force_sum_reduction_for_comms(True)  # sum, then divide: gloo has no pre-scaled sum
    return model


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter and register the shards again (the root stays gathered after forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
