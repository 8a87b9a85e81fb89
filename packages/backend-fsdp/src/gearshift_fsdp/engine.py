"""Train backend `fsdp`: PyTorch FSDP2 (`fully_shard`) over the dp ranks, any `AutoModelForCausalLM`;
tensor parallelism (`mesh` tp > 1, the model's own plan) and Ulysses sequence parallelism (sp > 1) beside it.

It is the core's `ModuleTrainEngine` given an `FSDPSharding` (sharding.py): the
model is sharded by `parallelize_causal_lm` (after `parallelize_tensor` with
tp), the weight spec describes the DTensor shards (so the core's plan and
stream do any export, point to point), and clipping knows the state is
sharded; the engine adds checkpoints of its shards (torch.distributed.checkpoint).
Ranks of one tp or sp group are given the same batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from gearshift import dist as gdist
from gearshift.module_train import ModuleTrainEngine
from gearshift.options import option, parse_dtype
from gearshift.tags import TRAIN_TAGS
from gearshift.train import TrainArgs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .parallelize import reshard
from .sharding import FSDPSharding


class FSDPTrainEngine(ModuleTrainEngine):
    """AdamW on FSDP2-sharded weights; dp sharding, or hybrid (replicate x shard) with `replicate > 1`.

    On a mesh of one rank there is nothing to shard, and FSDP2 would still copy every weight into a gathered
    copy before each micro-batch's forward and backward and each gradient through its reduction after it (at
    7B in bf16 on an H100 the train phase grew by about 0.1 s with each micro-batch more: 9.4 s in 16 in a run's
    first step, 12.1 s in 43 in its later ones). There the module trains as it is (`one_rank`), unless FSDP
    casts the weights to a lower `param_dtype` or keeps them in host memory (`cpu_offload`).

    `dtype` is the dtype of the sharded master weights; `param_dtype` the compute
    dtype of gathered weights. Hybrid sharding (HSDP, `replicate > 1`): the dp ranks
    form `replicate` groups of dp/replicate consecutive ranks; each group holds one
    copy sharded over its members, gradients are reduce-scattered in the group and
    all-reduced across groups.
    """

    requires = ("torch",)
    install = "pip install gearshift-fsdp"
    contract = 2
    memory_hints = ("keep the sharded state in host memory (train.options.cpu_offload=true, its step on the CPU)",
                    "shard over more GPUs (train.mesh)")

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
        one_rank: str = option("auto", "on a mesh of one rank, where FSDP shards nothing: 'plain' trains the "
                                       "module as it is, 'fsdp' wraps it all the same (a copy of the weights "
                                       "and of the gradients every micro-batch), 'auto' plain unless FSDP has "
                                       "work to do there (casting to param_dtype, cpu_offload)",
                               choices=("auto", "plain", "fsdp"))

    def __init__(self, args: TrainArgs, options: "FSDPTrainEngine.Options | None" = None) -> None:
        options = options or self.Options()
        gdist.ensure_process_group(options.device)
        device = torch.device(options.device) if options.device else gdist.default_device()
        sharding = FSDPSharding(
            args.resolved_mesh(), master_dtype=args.torch_dtype,
            param_dtype=parse_dtype(options.param_dtype) if options.param_dtype else default_param_dtype(device),
            reduce_dtype=parse_dtype(options.reduce_dtype), replicate=options.replicate,
            reshard_after_forward=options.reshard_after_forward, cpu_offload=options.cpu_offload,
            one_rank=options.one_rank)
        super().__init__(args, options, sharding)
        self.replicate, self.param_dtype, self.reduce_dtype = sharding.replicate, sharding.param_dtype, \
            sharding.reduce_dtype
        #: the torch device meshes: the one FSDP shards over, and (with tp or sp) the whole one; None where one
        #: rank trains the module as it is (`plain`)
        self.device_mesh, self.world_mesh = sharding.device_mesh, sharding.world_mesh
        self.plain = sharding.plain

    def _state_options(self) -> StateDictOptions:
        # with LoRA the frozen base is the model the engine was built from: the adapters are the state
        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)

    def save(self, path: str) -> None:
        """A torch.distributed.checkpoint folder: every rank writes its shards of model and optimizer (with
        LoRA, of the adapters and their optimizer state only)."""
        self.need_onloaded(TRAIN_TAGS, "save a checkpoint")
        reshard(self.model)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)

    def load(self, path: str) -> None:
        """Read a `save` folder into this engine's shards (any dp size that wrote it)."""
        self.need_onloaded(TRAIN_TAGS, "load a checkpoint")
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
