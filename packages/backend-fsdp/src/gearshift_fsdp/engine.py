"""Train backend `fsdp`: PyTorch FSDP2 (`fully_shard`) over the dp ranks, any `AutoModelForCausalLM`;
tensor parallelism (`mesh` tp > 1, the model's own plan) and Ulysses sequence parallelism (sp > 1) beside it.

It is the core's `ModuleTrainEngine` with its sharding hooks filled in: the
model is sharded by `parallelize_causal_lm` (after `parallelize_tensor` with
tp), the weight spec describes the DTensor shards (so the core's plan and
stream do any export, point to point), and offload, checkpoints and clipping
know the state is sharded. Ranks of one tp or sp group are given the same batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed.checkpoint as dcp
from gearshift import dist as gdist
from gearshift.mesh import Placement
from gearshift.module_train import ModuleTrainEngine
from gearshift.options import option, parse_dtype
from gearshift.tags import TRAIN_TAGS, check_tags
from gearshift.train import PolicyOutput, TrainArgs, TrainBatch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from . import sequence_parallel as ulysses
from .grads import clip_by_norm, sum_partial_grads
from .parallelize import build_device_mesh, build_dp_mesh, fsdp_mesh, parallelize_causal_lm, reshard
from .placement import placement_of


class FSDPTrainEngine(ModuleTrainEngine):
    """AdamW on FSDP2-sharded weights; dp sharding, or hybrid (replicate x shard) with `replicate > 1`.

    `dtype` is the dtype of the sharded master weights; `param_dtype` the compute
    dtype of gathered weights. Hybrid sharding (HSDP, `replicate > 1`): the dp ranks
    form `replicate` groups of dp/replicate consecutive ranks; each group holds one
    copy sharded over its members, gradients are reduce-scattered in the group and
    all-reduced across groups.
    """

    requires = ("torch",)
    install = "pip install gearshift-fsdp"
    contract = 2

    @dataclass(frozen=True)
    class Options(ModuleTrainEngine.Options):
        replicate: int = option(1, "hybrid sharding: groups holding one sharded copy each (1: plain FSDP)")
        param_dtype: str | None = option(None, "compute dtype of gathered weights (None: bfloat16 on a GPU that "
                                               "supports it, else the master dtype)")
        reduce_dtype: str = option("float32", "dtype gradients are reduced in")
        reshard_after_forward: bool | int = option(True, "free each layer's gathered weights after forward "
                                                         "(True), keep them for backward (False), or reshard to "
                                                         "a group of that many ranks (int)")
        cpu_offload: bool = option(False, "keep sharded weights, grads and optimizer state in host memory for "
                                          "good (FSDP2's CPUOffloadPolicy); the optimizer steps on the CPU")

    def __init__(self, args: TrainArgs, options: "FSDPTrainEngine.Options | None" = None) -> None:
        options = options or self.Options()
        gdist.ensure_process_group(options.device)
        device = torch.device(options.device) if options.device else gdist.default_device()
        self.replicate = int(options.replicate)
        self.param_dtype = parse_dtype(options.param_dtype) if options.param_dtype else default_param_dtype(device)
        self.compute_dtype = self.param_dtype or args.torch_dtype
        self.reduce_dtype = parse_dtype(options.reduce_dtype)
        super().__init__(args, options)

    # --- sharding hooks -------------------------------------------------------------------
    def _check_mesh(self) -> None:
        if self.mesh.pp != 1:
            raise ValueError(f"the fsdp backend has no pipeline parallelism, but mesh {self.mesh} has "
                             f"pp={self.mesh.pp}: use dp, tp and sp (for example dp={self.mesh.world_size})")
        if self.replicate > 1 and (self.mesh.tp > 1 or self.mesh.sp > 1):
            raise ValueError(f"hybrid sharding (replicate={self.replicate}) runs over dp alone, but mesh "
                             f"{self.mesh} has tp or sp > 1: use replicate=1 with tp or sp")
        if self.replicate < 1 or self.mesh.dp % self.replicate:
            raise ValueError(f"replicate={self.replicate} must divide dp={self.mesh.dp}")

    @property
    def _plain_dp(self) -> bool:
        return self.mesh.tp == 1 and self.mesh.sp == 1

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        #: parameters whose gradients each tp rank computes only in part (summed over tp after backward)
        self._partial_grads: list[str] = []
        if self._plain_dp:
            self.device_mesh = build_dp_mesh(self.mesh, self.device.type, self.replicate)
        else:
            self.world_mesh = build_device_mesh(self.mesh, self.device.type)
            self.device_mesh = fsdp_mesh(self.world_mesh)
            if self.mesh.sp > 1:
                ulysses.check_heads(self.hf_model.config, sp=self.mesh.sp, tp=self.mesh.tp)
                ulysses.use_ulysses_attention(self.hf_model, self.world_mesh["sp"].get_group())
            if self.mesh.tp > 1:
                from gearshift.tensor_parallel import parallelize_tensor

                applied = parallelize_tensor(model, self.hf_model, self.world_mesh["tp"])
                self._partial_grads = list(applied.partial_grads)
        return parallelize_causal_lm(
            model,
            mesh=self.device_mesh,
            param_dtype=None if self.param_dtype == self.dtype else self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.options.reshard_after_forward,
            cpu_offload=self.options.cpu_offload,
            # sequence-parallel ranks each hold a part of the same sequences: their gradients add up
            gradient_divide_factor=float(self.mesh.dp) if self.mesh.sp > 1 else None,
        )

    def _placement(self, name: str, param: torch.Tensor) -> Placement:
        return placement_of(param, self.mesh)

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def _clip_and_step(self) -> float:
        if self._plain_dp:
            return super()._clip_and_step()
        if self._partial_grads:
            named = dict(self.model.named_parameters())
            sum_partial_grads([named[n] for n in self._partial_grads], self.world_mesh["tp"].get_group())
        norm = clip_by_norm(list(self._params.values()), self.args.max_grad_norm)
        self.optimizer.step()
        return norm

    def _forward(self, batch: TrainBatch, with_entropy: bool) -> PolicyOutput:
        if self.mesh.sp == 1:
            return super()._forward(batch, with_entropy)
        return ulysses.forward(self.model, batch.to(self.device), self.world_mesh["sp"], with_entropy,
                               value_head=self.args.value_head)

    # --- interface ------------------------------------------------------------------------
    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        try:
            return super().forward_logprobs(batch, with_entropy)
        finally:
            reshard(self.model)  # else the root's weights stay gathered (for a backward that is not coming)

    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """As the base does, after freeing gathered weights; state FSDP keeps in host memory (`cpu_offload`)
        stays there and counts 0 bytes."""
        if "params" in check_tags(tags, TRAIN_TAGS):
            reshard(self.model)
        return super().offload(tags)

    def _state_options(self) -> StateDictOptions:
        # with LoRA the frozen base is the model the engine was built from: the adapters are the state
        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)

    def save(self, path: str) -> None:
        """A torch.distributed.checkpoint folder: every rank writes its shards of model and optimizer (with
        LoRA, of the adapters and their optimizer state only)."""
        self._need_onloaded(TRAIN_TAGS, "save a checkpoint")
        reshard(self.model)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)

    def load(self, path: str) -> None:
        """Read a `save` folder into this engine's shards (any dp size that wrote it)."""
        self._need_onloaded(TRAIN_TAGS, "load a checkpoint")
        reshard(self.model)
        options = self._state_options()
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_state, "optimizer": optim_state}
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:  # every rank's stack; the key it misses is the news
            missing = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(e), re.M)
            if missing is None:
                raise
            what = "LoRA adapters (same lora_r and lora_target_modules?)" if self.lora else "model"
            raise RuntimeError(f"{path} does not hold this engine's {what}: it has no {missing.group(1)} "
                               f"(a checkpoint of a LoRA run holds only the adapters)") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)


def default_param_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 compute where the device supports it, else none (the master dtype)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None
