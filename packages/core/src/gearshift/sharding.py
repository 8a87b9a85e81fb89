"""`Sharding`: what a trainer built on `ModuleTrainEngine` supplies about how its model lies over the mesh.

`ModuleTrainEngine(args, options, sharding=...)` runs everything else: loading,
micro-batched steps, log-probabilities, the weight spec, offload, checkpoints.
The base class is one process: the model moved to its device, every weight whole,
torch's AdamW with global-norm clipping. A backend subclasses it and overrides
the methods its layout changes, each a public method of its own (torchtitan
passes its parallelism in as data the same way):

- `check(mesh)`: refuse a mesh it cannot run;
- `parallelize(model, hf_model, device)`: wrap or shard the module; returns the module forward runs;
- `compile(model, mesh)`: compile that module's decoder layers (`train.options.compile`), or refuse;
- `trained_parameters(model)`: the parameters it trains, under Hugging Face names;
- `placement(name, param, mesh)`, `local(tensor)`, `full_shape(name, param)`: each weight's placement,
  this rank's shard of it (or of its gradient or optimizer state), its whole shape;
- `optimizer(params, lr, weight_decay, betas)`, `backward(loss)`,
  `clip_and_step(params, optimizer, max_grad_norm)`: the update;
- `forward(model, batch, with_entropy, value_head, layout, mask_kind)`: log-probabilities (a sequence-parallel
  forward differs), of rows packed by prompt when given a `layout` and `shares_prompts` is true;
- `materialized(params)`: gather weights not addressable shard by shard, around each bucket of an export;
- `release(model)`: free weights gathered beyond the shards (after a forward with no backward, before offload);

and two attributes: `compute_dtype` (None: the dtype the weights are loaded in)
and `lends_weights` (False where the weights exist whole only while gathered).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Iterable, Sequence

import torch
from torch import nn

from .layers import compile_layers
from .mesh import MeshSpec, Placement
from .policy import policy_forward
from .shared_prefix import Layout
from .train import PolicyOutput, TrainBatch


class Sharding:
    """One process, nothing sharded: the default of `ModuleTrainEngine`, and the base of a backend's."""

    #: the dtype forward and backward compute in (None: the dtype the weights are loaded in)
    compute_dtype: torch.dtype | None = None
    #: the weights stay whole and valid between exports, so a rollout engine may serve from them
    lends_weights: bool = True

    def check(self, mesh: MeshSpec) -> None:
        """Raise `ValueError`, naming the mesh and what would run, if the layout cannot run on `mesh`."""
        if mesh.world_size != 1:
            raise ValueError(f"a trainer without sharding runs in one process; for mesh {mesh} use a sharding "
                             f"backend such as 'fsdp'")

    def parallelize(self, model: nn.Module, hf_model: nn.Module, device: torch.device) -> nn.Module:
        """The module forward and backward run: `model` (the causal LM, or a `ValueHeadModel` around
        `hf_model`) wrapped or sharded. Default: moved to `device`."""
        return model.to(device)

    def compile(self, model: nn.Module, mesh: MeshSpec) -> None:
        """Compile the module `parallelize` returned, for `train.options.compile`: each decoder layer's forward
        (`gearshift.layers.compile_layers`). Raise `ValueError`, saying why, where this layout cannot."""
        compile_layers(model)

    def trained_parameters(self, model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
        """The parameters that train, under Hugging Face names, from the module `parallelize` returned."""
        return ((n, p) for n, p in model.named_parameters() if p.requires_grad)

    def placement(self, name: str, param: torch.Tensor, mesh: MeshSpec) -> Placement:
        """Where `param` lies on `mesh`. Default: whole on every rank."""
        return Placement.replicated(mesh)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a parameter, gradient or optimizer-state tensor. Default: the tensor."""
        return tensor

    def full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        """The whole weight's shape (a DTensor's is its own; ZeRO-3 keeps it beside an empty local tensor)."""
        return tuple(param.shape)

    def optimizer(self, params: Sequence[nn.Parameter], lr: float, weight_decay: float,
                  betas: tuple[float, float]) -> torch.optim.Optimizer:
        """The optimizer over the trained parameters. Default: torch's AdamW, fused where it can be
        (`adamw_kernel`)."""
        params = list(params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas),
                                 **adamw_kernel(params))

    @property
    def shares_prompts(self) -> bool:
        """Whether `forward` takes a `layout` (gearshift.shared_prefix: rows packed by prompt). Default: yes."""
        return True

    def forward(self, model: nn.Module, batch: TrainBatch, with_entropy: bool, value_head: bool,
                layout: Layout | None = None, mask_kind: str = "bool") -> PolicyOutput:
        """Log-probabilities (values, for a critic) of `batch`, on the device already (`policy_forward`); with a
        `layout`, of its rows packed by prompt under a 4-D mask of `mask_kind`."""
        return policy_forward(model, batch, with_entropy, value_head, layout=layout, mask_kind=mask_kind)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of one micro-batch's loss (weighed by its share of the batch already)."""
        loss.backward()

    def clip_and_step(self, params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer,
                      max_grad_norm: float | None) -> float:
        """Clip the gradients to `max_grad_norm` over every shard (None: no clipping), step; returns the norm
        before clipping, the same on every rank."""
        params = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm of this rank's shards, reduced here
            norm = norm.full_tensor()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm, foreach=True)
        optimizer.step()
        return float(norm)

    def materialized(self, params: Sequence[torch.Tensor]) -> AbstractContextManager:
        """Entered around each bucket of an export with the parameters it reads: gather those that are not
        addressable shard by shard, let go on exit. Every rank enters it in the same order. Default: nothing."""
        return nullcontext()

    def release(self, model: nn.Module) -> None:
        """Free weights still gathered beyond this rank's shards (after a forward with no backward, before
        params are offloaded or a checkpoint is taken). Default: nothing is gathered."""


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict:
    """AdamW's implementation for these parameters: `fused` (one kernel a step over every tensor, in float32
    whatever the weights' dtype) where all are plain CUDA tensors, torch's default elsewhere (its `foreach`
    kernels on a CPU and for DTensor shards, where fused was not measured)."""
    from torch.distributed.tensor import DTensor

    fused = bool(params) and all(p.device.type == "cuda" and not isinstance(p, DTensor) for p in params)
    return {"fused": True} if fused else {}


def adam_state_sizes(trained: Sequence[torch.Tensor], fused: bool) -> list[int]:
    """Bytes of each device storage torch's AdamW allocates for `trained` at its first step: two moments each,
    and with `fused` a float32 step count each beside them (foreach AdamW keeps its step counts on the host)."""
    step = [4] if fused else []
    return [n for t in trained for n in [t.numel() * t.element_size()] * 2 + step]


#: the private hooks `ModuleTrainEngine` subclasses overrode before a `Sharding` was passed, and what replaced each
MOVED_HOOKS = {
    "_check_mesh": "Sharding.check", "_parallelize": "Sharding.parallelize", "_placement": "Sharding.placement",
    "_local": "Sharding.local", "_full_shape": "Sharding.full_shape",
    "_named_parameters": "Sharding.trained_parameters", "_build_optimizer": "Sharding.optimizer",
    "_backward": "Sharding.backward", "_clip_and_step": "Sharding.clip_and_step",
    "_state_tensors": "ModuleTrainEngine.state_tensors", "_need_onloaded": "ModuleTrainEngine.offloaded",
    "_export_parameters": "ModuleTrainEngine.export_parameters",
}


def refuse_moved_hooks(cls: type) -> None:
    """Raise `TypeError` when a trainer class defines one of the hooks the engine no longer calls (it would
    be ignored without a word), naming what replaced it."""
    found = {n: MOVED_HOOKS[n] for n in vars(cls) if n in MOVED_HOOKS}
    if found:
        moved = ", ".join(f"{n} -> {m}" for n, m in found.items())
        raise TypeError(f"{cls.__qualname__} overrides hooks ModuleTrainEngine no longer calls ({moved}): "
                        f"pass a gearshift.sharding.Sharding subclass to ModuleTrainEngine.__init__ instead")


__all__ = ["MOVED_HOOKS", "Sharding", "refuse_moved_hooks"]
