"""Train backend `fsdp`: PyTorch FSDP2 (`fully_shard`) over the dp ranks, any `AutoModelForCausalLM`.

It is the core's `TorchTrainEngine` with its sharding hooks filled in: the
model is sharded by `parallelize_causal_lm`, the weight spec describes the
DTensor shards (so the core's plan and stream do any export, point to point),
and offload, checkpoints and clipping know the state is sharded.
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gearshift import dist as gdist
from gearshift.backends.torch_train import TorchTrainEngine, parse_dtype
from gearshift.mesh import MeshSpec
from gearshift.train import TRAIN_TAGS, LossFn, PolicyOutput, TrainBatch, check_tags
from gearshift.weights import ParamSpec, WeightSpec
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from .offload import HostStash
from .parallelize import build_dp_mesh, parallelize_causal_lm, reshard
from .placement import placement_of


class FSDPTrainEngine(TorchTrainEngine):
    """AdamW on FSDP2-sharded weights; dp sharding, or hybrid (replicate x shard) with `replicate > 1`.

    Options beyond those of `TorchTrainEngine` (`dtype` is the dtype of the
    sharded master weights; `gradient_checkpointing` turns on activation
    checkpointing):

    - `replicate`: hybrid sharding (HSDP). The dp ranks form `replicate` groups
      of dp/replicate consecutive ranks; each group holds one copy sharded over
      its members, gradients are reduce-scattered in the group and all-reduced
      across groups. 1 (default): plain FSDP over all dp ranks.
    - `param_dtype`: the compute dtype of gathered weights. Default: bfloat16
      on a GPU that supports it, else `dtype` (no mixed precision on a CPU).
    - `reduce_dtype`: the dtype gradients are reduced in (default float32).
    - `reshard_after_forward`: free each layer's gathered weights after forward
      (True), keep them until backward (False), or reshard to a smaller group
      of that many ranks (int).
    - `cpu_offload`: keep the sharded weights, gradients and optimizer state in
      host memory for good (FSDP2's `CPUOffloadPolicy`); the optimizer steps on
      the CPU.
    """

    requires = ("torch",)
    install = "pip install gearshift-fsdp"

    def __init__(
        self,
        model: str,
        *,
        mesh: MeshSpec | None = None,
        replicate: int = 1,
        param_dtype: str | None = None,
        reduce_dtype: str = "float32",
        reshard_after_forward: bool | int = True,
        cpu_offload: bool = False,
        **options,
    ) -> None:
        join_process_group(options.get("device"))
        device = torch.device(options["device"]) if options.get("device") else gdist.default_device()
        self.replicate = int(replicate)
        self.param_dtype = parse_dtype(param_dtype) if param_dtype else default_param_dtype(device)
        self.reduce_dtype = parse_dtype(reduce_dtype)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = bool(cpu_offload)
        self._stashes: dict[str, HostStash] = {}
        super().__init__(model, mesh=mesh or MeshSpec(dp=gdist.world_size()), **options)
        self._spec = WeightSpec(self.mesh, tuple(
            ParamSpec(n, tuple(p.shape), p.dtype, placement_of(p, self.mesh)) for n, p in self._params.items()
        ))

    # --- sharding hooks -------------------------------------------------------------------
    def _check_mesh(self) -> None:
        if self.mesh.dp != self.mesh.world_size:
            raise ValueError(f"the fsdp backend shards over dp ranks only, but mesh {self.mesh} has "
                             f"tp/pp/sp > 1: use mesh dp={self.mesh.world_size}")
        if self.replicate < 1 or self.mesh.dp % self.replicate:
            raise ValueError(f"replicate={self.replicate} must divide dp={self.mesh.dp}")

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        self.device_mesh = build_dp_mesh(self.mesh, self.device.type, self.replicate)
        return parallelize_causal_lm(
            model,
            mesh=self.device_mesh,
            param_dtype=None if self.param_dtype == self.dtype else self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
        )

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def _clip_grad_norm(self) -> float:
        params = [p for p in self._params.values() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):  # a partial sum over the shards: reduce it
            norm = norm.full_tensor()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, foreach=True)
        return float(norm)

    # --- interface ------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    def local_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        self._need_onloaded(["params"], "export weights")
        return super().local_weights(names)

    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        self._need_onloaded(["params"], "run forward")
        try:
            return super().forward_logprobs(batch, with_entropy)
        finally:
            reshard(self.model)  # else the root's weights stay gathered (for a backward that is not coming)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self._need_onloaded(TRAIN_TAGS, "train")
        metrics = super().train_step(batch, loss_fn)
        return self._mean_over_ranks(metrics)

    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """Copy the tagged state to host memory and free it on the device.

        State already in host memory (on a CPU, or with `cpu_offload`) stays where it
        is and counts 0 bytes: nothing is copied for show.
        """
        moved = 0
        for tag in check_tags(tags, TRAIN_TAGS):
            if tag in self._stashes:
                continue
            if tag == "params":
                reshard(self.model)
            stash = HostStash()
            moved += stash.offload(t for t in self._state(tag) if t.device.type != "cpu")
            if len(stash):
                self._stashes[tag] = stash
        return moved

    def onload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        tags = check_tags(tags, TRAIN_TAGS)
        return sum(self._stashes.pop(tag).restore() for tag in TRAIN_TAGS if tag in tags and tag in self._stashes)

    def save(self, path: str) -> None:
        """A torch.distributed.checkpoint folder: every rank writes its shards of model and optimizer."""
        self._need_onloaded(TRAIN_TAGS, "save a checkpoint")
        reshard(self.model)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)

    def load(self, path: str) -> None:
        """Read a `save` folder into this engine's shards (any dp size that wrote it)."""
        self._need_onloaded(TRAIN_TAGS, "load a checkpoint")
        reshard(self.model)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def save_hf(self, path: str) -> None:
        """Gather the full weights bucket by bucket; rank 0 keeps them and writes the folder and tokenizer."""
        from transformers import AutoTokenizer

        rank = gdist.rank()
        state: dict[str, torch.Tensor] = {}
        for bucket in self.export_weights():
            if rank == 0:
                state.update((k, v.detach().to("cpu", copy=True)) for k, v in bucket.items())
        if rank == 0:
            self._write_hf(path, state)
            try:
                AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
            except (OSError, ValueError) as err:
                warnings.warn(f"save_hf: no tokenizer copied from {self.model_path}: {err}", stacklevel=2)
        del state
        gdist.barrier()

    def _write_hf(self, path: str, state: dict[str, torch.Tensor]) -> None:
        if not self.value_head:
            self.model.save_pretrained(path, state_dict=state)
            return
        # a critic: the language model as a Hugging Face folder, its value head beside it
        from safetensors.torch import save_file

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}

        self.model.lm.save_pretrained(path, state_dict=part("lm."))
        save_file(part("value_head."), os.path.join(path, "value_head.safetensors"))

    def close(self) -> None:
        self._stashes.clear()
        self._params.clear()
        self.optimizer = None
        self.model = None

    # --- helpers --------------------------------------------------------------------------
    def _state(self, tag: str) -> list[torch.Tensor]:
        """The local tensors holding the tagged state on this rank."""
        with torch.no_grad():
            if tag == "params":
                return [self._local(p) for p in self._params.values()]
            if tag == "grads":
                return [self._local(p.grad) for p in self._params.values() if p.grad is not None]
            return [self._local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]

    def _need_onloaded(self, tags: Sequence[str], action: str) -> None:
        away = [t for t in tags if t in self._stashes]
        if away:
            raise RuntimeError(f"cannot {action}: {away} are offloaded to host memory; call onload({away}) first")

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Per-rank metrics averaged over the dp ranks (each saw its own part of the batch)."""
        if gdist.world_size() == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=gdist.collective_device())
        dist.all_reduce(values)
        return dict(zip(keys, (values / gdist.world_size()).tolist()))


def join_process_group(device: str | None = None) -> None:
    """Join torchrun's process group; a plain single process gets a group of one (FSDP needs a mesh).

    On a GPU the group has a gloo side beside nccl: state kept in host memory
    (`cpu_offload`) is reduced there, as are a checkpoint's host-side objects.
    """
    if gdist.is_distributed():
        return
    cuda = torch.device(device).type == "cuda" if device else torch.cuda.is_available()
    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"
    if cuda:
        index = torch.device(device).index if device else None
        torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        gdist.init(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def default_param_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 compute where the device supports it, else none (the master dtype)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None
