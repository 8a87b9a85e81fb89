"""Train backend `torch`: plain PyTorch, one process, any `AutoModelForCausalLM` from a local path.

It is the reference the sharded backends are checked against, and the base
they build on: `_parallelize` is the one hook a sharding backend replaces.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from .. import dist as gdist
from ..mesh import MeshSpec
from ..train import TRAIN_TAGS, LossFn, PolicyOutput, TrainBatch, TrainEngine, check_tags, token_logprobs
from ..weights import WeightSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left and right padding give the same logits."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class TorchTrainEngine(TrainEngine):
    """AdamW on one device; micro-batched steps with gradient clipping."""

    def __init__(
        self,
        model: str,
        *,
        mesh: MeshSpec | None = None,
        dtype: str = "float32",
        device: str | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int | None = None,
        gradient_checkpointing: bool = False,
        value_head: bool = False,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = str(model)
        self.mesh = (mesh or MeshSpec()).validate(gdist.world_size())
        self._check_mesh()
        self.device = torch.device(device) if device else gdist.default_device()
        self.dtype = parse_dtype(dtype)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.value_head = value_head
        torch.manual_seed(seed)
        model_ = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model_.config.use_cache = False
        if gradient_checkpointing:
            model_.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if value_head:
            from ..critic import ValueHeadModel

            model_ = ValueHeadModel(model_)
        self.model = self._parallelize(model_)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=lr, weight_decay=weight_decay, betas=tuple(betas),
        )
        self._params = dict(self.model.named_parameters())
        self._host_grads: dict[str, torch.Tensor] = {}

    # --- sharding hooks -------------------------------------------------------------------
    def _check_mesh(self) -> None:
        if self.mesh.world_size != 1:
            raise ValueError(f"the torch train backend runs in one process; for mesh {self.mesh} use 'fsdp'")

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if self.device.type == "cpu":
            # from_pretrained may leave CPU weights as views of the checkpoint's file mapping: reading
            # them (every sync) then runs at page-cache speed, and the first optimizer step copy-faults
            # every page. One copy now puts them in ordinary memory.
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.clone()
        return model

    def _shards(self, name: str) -> dict[str, int]:
        """{axis: dim} for how `name` is sharded on the train mesh."""
        return {}

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # --- interface ------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return WeightSpec.from_tensors(
            {n: p for n, p in self._params.items()}, self.mesh, {n: self._shards(n) for n in self._params}
        )

    def local_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self._local(self._params[n].detach()) for n in names}

    def _forward(self, batch: TrainBatch, with_entropy: bool) -> PolicyOutput:
        batch = batch.to(self.device)
        out = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask,
            position_ids=position_ids(batch.attention_mask), use_cache=False,
        )
        if self.value_head:  # a critic: values instead of log-probabilities
            return PolicyOutput(torch.zeros_like(out), values=out)
        return token_logprobs(out.logits, batch.input_ids, with_entropy)

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        """Log-probabilities (and entropies), or values for an engine built with `value_head=True`."""
        self.model.eval()
        outs = [self._forward(mb, with_entropy) for mb in batch.micro_batches(self.micro_batch_size)]
        def cat(field: str):
            parts = [getattr(o, field) for o in outs]
            return None if parts[0] is None else torch.cat(parts)
        return PolicyOutput(cat("logprobs"), cat("entropy"), cat("values"))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for mb in batch.micro_batches(self.micro_batch_size):
            weight = mb.size / batch.size
            out = self._forward(mb, with_entropy=True)
            loss, metrics = loss_fn(out, mb.to(self.device))
            (loss * weight).backward()
            for k, v in {"loss": float(loss.detach()), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + float(v) * weight
        totals["grad_norm"] = self._clip_grad_norm()
        self.optimizer.step()
        totals["lr"] = self.optimizer.param_groups[0]["lr"]
        return totals

    def _slots(self, tag: str) -> list[tuple]:
        """(get, put) for every tensor of `tag`; `put` stores a moved copy in its place."""
        if tag == "params":
            return [(lambda p=p: p.data, lambda t, p=p: setattr(p, "data", t)) for p in self._params.values()]
        if tag == "grads":  # a CUDA parameter cannot hold a host gradient: offloaded grads wait beside it
            def put(t, name, p):
                if t.device.type == "cpu" and self.device.type != "cpu":
                    self._host_grads[name], p.grad = t, None
                else:
                    self._host_grads.pop(name, None)
                    p.grad = t
            return [(lambda n=n, p=p: self._host_grads.get(n, p.grad), lambda t, n=n, p=p: put(t, n, p))
                    for n, p in self._params.items() if p.grad is not None or n in self._host_grads]
        return [(lambda st=st, k=k: st[k], lambda t, st=st, k=k: st.__setitem__(k, t))
                for st in self.optimizer.state.values() for k, v in st.items() if torch.is_tensor(v)]

    def _move(self, tags: Sequence[str], target: torch.device) -> int:
        moved = 0
        pin = target.type == "cpu" and torch.cuda.is_available()
        for tag in check_tags(tags, TRAIN_TAGS):
            for get, put in self._slots(tag):
                t = get()
                if t.device == target:
                    continue
                dst = torch.empty(t.shape, dtype=t.dtype, device=target, pin_memory=pin)
                dst.copy_(t, non_blocking=True)
                put(dst)
                moved += t.numel() * t.element_size()
        gdist.synchronize(self.device)
        return moved

    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """On a CPU device the state already lives in host memory: nothing moves, 0 bytes."""
        return self._move(tags, torch.device("cpu"))

    def onload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        return self._move(tags, self.device)

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   os.path.join(path, "train_state.pt"))

    def load(self, path: str) -> None:
        state = torch.load(os.path.join(path, "train_state.pt"), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_hf(self, path: str) -> None:
        from transformers import AutoTokenizer

        state = {}
        for bucket in self.export_weights():
            state.update((k, v.detach().cpu()) for k, v in bucket.items())
        if gdist.rank() == 0:
            self.model.save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
        gdist.barrier()
