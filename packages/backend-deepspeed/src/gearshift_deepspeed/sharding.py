"""`ZeroSharding`: DeepSpeed ZeRO as the core's `Sharding` asks it of a trainer.

`deepspeed.initialize` wraps the model and a torch AdamW (or DeepSpeed's own);
DeepSpeed's engine runs backward (accumulating the micro-batches the base
weighs), the reduction, clipping, the global gradient norm and the step. At
stage 1 and 2 every rank holds every weight whole. At stage 3 the weights live
as flat partitions with no per-dimension layout: each is described as whole on
every rank (its shape kept in `ds_shape`) and gathered only around a bucket of
an export (`materialized`), so a rollout engine cannot serve from them. The
gather reads the partitions themselves, one all-gather per bucket (gather.py);
`local(param)` is the whole weight inside it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator, Sequence

import torch
from gearshift.mesh import MeshSpec
from gearshift.sharding import Sharding
from torch import nn

from .config import deepspeed_config
from .gather import PartitionGather
from .runtime import import_deepspeed, initialize


#: why `train.options.compile` is refused here
NO_COMPILE = ("train.options.compile: the deepspeed trainer does not compile its layers (ZeRO-3 gathers each "
              "module's weights in hooks inside a layer); use train.backend=fsdp to compile them")


class ZeroSharding(Sharding):
    """ZeRO stage 1, 2 or 3 over the dp ranks; `engine` is DeepSpeed's, once `parallelize` made it."""

    def __init__(self, *, zero_stage: int, compute_dtype: torch.dtype, lr: float, weight_decay: float,
                 betas: tuple[float, float], max_grad_norm: float | None, offload_params: bool = False,
                 offload_optimizer: bool = False, fused_optimizer: bool = False, overrides: dict | None = None,
                 gather_partitions: bool = True) -> None:
        self.zero_stage = int(zero_stage)
        self.compute_dtype = compute_dtype
        self.lends_weights = self.zero_stage < 3  # ZeRO-3's weights exist whole only while gathered
        self.adamw = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas))
        self.max_grad_norm = max_grad_norm
        self.offload_params, self.offload_optimizer = offload_params, offload_optimizer
        self.fused_optimizer = fused_optimizer
        self.overrides = dict(overrides or {})
        #: at stage 3, export from the partitions (False: DeepSpeed's GatheredParameters, see `materialized`)
        self.gather_partitions = gather_partitions
        self.engine = None
        self._partitions: PartitionGather | None = None
        self._whole: dict[int, torch.Tensor] = {}  # id(param) -> the weight whole, inside `materialized`

    def compile(self, model: nn.Module, mesh: MeshSpec) -> None:
        raise ValueError(NO_COMPILE)

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
        if self.zero_stage == 3 and self.gather_partitions:
            self._partitions = PartitionGather(device)
        return self.engine

    def trained_parameters(self, model: nn.Module):
        return ((n, p) for n, p in model.module.named_parameters() if p.requires_grad)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor; inside `materialized` at stage 3, a parameter of the bucket whole (gathered from its
        partitions: the parameter itself stays empty)."""
        return self._whole.get(id(tensor), tensor)

    def full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        return tuple(getattr(param, "ds_shape", param.shape))  # stage 3 keeps an empty tensor beside it

    def optimizer(self, params, lr, weight_decay, betas) -> torch.optim.Optimizer:
        return self.engine.optimizer  # DeepSpeed's ZeRO optimizer around the AdamW given to it

    def master_partitions(self) -> list[torch.Tensor]:
        """The flat partitions DeepSpeed's optimizer steps: this rank's master weights (fp32 under bf16 mixed
        precision), one per sub-group at stage 3, one per parameter group at stages 1 and 2."""
        opt = self.engine.optimizer
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)  # stage 3
        if flats is None:
            flats = getattr(opt, "single_partition_of_fp32_groups", None)  # stages 1 and 2
        return [t for t in flats or () if torch.is_tensor(t)]

    def stepped(self) -> bool:
        """Whether the optimizer has stepped, so that Adam's moments exist (they are made at the first step)."""
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        return bool(getattr(inner, "state", None))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the base has weighed each micro-batch's loss already

    def clip_and_step(self, params, optimizer, max_grad_norm) -> float:
        """DeepSpeed reduces, clips to `max_grad_norm` and steps; the norm is before clipping, over all ranks."""
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def materialized(self, params: Sequence[torch.Tensor]) -> AbstractContextManager:
        """At stage 3, `params` whole on every rank (through `local`) until the context closes.

        They are read from the partitions with one all-gather per bucket (gather.py). Where that does
        not apply, DeepSpeed's `GatheredParameters` gathers them parameter by parameter instead, leaving
        those a surrounding gather holds already be: with LoRA (`gather_partitions=False`: the merge reads
        the base and adapter parameters themselves, so they must be whole as parameters), and for a bucket
        that `gather.refusal` turns down (a parameter DeepSpeed did not partition, partitions offloaded to
        host memory while training on a GPU or swapped out to NVMe, quantized ones).
        """
        if self.zero_stage < 3:
            return nullcontext()
        layout = self._partitions.layout(params) if self._partitions is not None else None
        if layout is None:
            deepspeed = import_deepspeed()
            unavailable = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE
            return deepspeed.zero.GatheredParameters([p for p in params if p.ds_status == unavailable])
        return self._read_whole(layout, params)

    @contextmanager
    def _read_whole(self, layout, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """`local(p)` is `p` whole for each of `params` inside; an enclosing export's weights stay readable."""
        outer = self._whole
        self._whole = {**outer, **dict(zip(map(id, params), self._partitions.gather(layout, params)))}
        try:
            yield
        finally:
            self._whole = outer  # the gathered tensors go with their last reader


def update_bytes(partitions: Sequence[int], zero_stage: int, stepped: bool) -> int:
    """Device bytes a ZeRO optimizer step allocates beyond the state held, for master partitions of `partitions`
    bytes on the device: Adam's two moments of each before the first step makes them, the master-dtype
    gradients the step reads (all partitions at stages 1 and 2; at stage 3 one sub-group at a time, the gradient
    partitions themselves held from the start), and one temporary the size of the largest partition."""
    if not partitions:
        return 0
    moments = 0 if stepped else 2 * sum(partitions)
    grads = max(partitions) if zero_stage == 3 else sum(partitions)
    return moments + grads + max(partitions)


__all__ = ["NO_COMPILE", "ZeroSharding", "update_bytes"]
