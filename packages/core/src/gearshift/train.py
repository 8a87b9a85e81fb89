"""The training-engine interface: what the RL loop and the resharder ask of a trainer.

Log-probabilities are aligned with the tokens: `logprobs[:, t]` is
log p(input_ids[:, t] | input_ids[:, :t]), and position 0 holds 0. A
`loss_mask` of 1 marks the tokens a loss is taken over (the responses).

Construction (gearshift.options): every trainer is built by
`Engine.build(model, **options)` from the common `TrainArgs` below plus its own
`Options` dataclass, and sets `device` and `mesh`. Process groups: under
torchrun, `build` joins the group (`gearshift.dist.init`) before the engine
exists; an engine uses the default group and never destroys it. In a plain
single process, an engine that needs a group makes one of size 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator, Sequence

import torch

from .logprobs import picked_logprobs
from .mesh import MeshSpec
from .options import Buildable, EngineArgs, option
from .tags import TRAIN_TAGS, check_tags
from .weights import Adapter, WeightSpec


@dataclass(frozen=True)
class TrainArgs(EngineArgs):
    """What every train engine is built from (besides its own `Options`)."""

    lr: float = option(1e-5, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float | None = option(1.0, "clip the global gradient norm to this (None: no clipping)")
    micro_batch_size: int | None = option(None, "sequences per forward/backward (None: the whole batch at once)")
    max_tokens_per_micro_batch: int | None = option(
        None, "pack sequences by length into micro-batches of at most this many tokens, padding included "
              "(rows x the longest row; a longer sequence goes alone); with micro_batch_size, that many rows at "
              "most (None: micro-batches of micro_batch_size sequences)")
    share_prompts: bool | None = option(
        None, "compute a prompt once for all the rows that begin with it (GRPO's n samples): one packed sequence "
              "per prompt, each row seeing the prompt and itself; the same log-probabilities and gradients up to "
              "float rounding (None: on a CPU, where it was measured, for a batch where packing computes less "
              "than running rows apart; off on a GPU until measured there)")
    value_head: bool = option(False, "a critic: a linear value head on the decoder; forward_logprobs returns values")
    dropout: bool = option(False, "train with the model's dropout; off by default, since an on-policy update "
                                  "with dropout is off-policy")


@dataclass
class TrainBatch:
    """Padded token sequences plus any per-sequence or per-token tensors a loss needs."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T], 1 on trained tokens
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [B] or [B, T]

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(self.input_ids.shape)}")
        for name in ("attention_mask", "loss_mask"):
            if getattr(self, name).shape != self.input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"input_ids {tuple(self.input_ids.shape)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens of each row the model attends to (prompt and response)."""
        return self.attention_mask.sum(-1)

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
            {k: v.to(device) for k, v in self.extras.items()},
        )

    def select(self, index: slice | torch.Tensor) -> "TrainBatch":
        return TrainBatch(
            self.input_ids[index], self.attention_mask[index], self.loss_mask[index],
            {k: v[index] for k, v in self.extras.items()},
        )

    def micro_batches(self, size: int | None) -> Iterator["TrainBatch"]:
        size = size or self.size
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))

    def trimmed(self) -> "TrainBatch":
        """The batch without its trailing columns that no row attends to; [B, T] extras are cut alike."""
        used = torch.nonzero(self.attention_mask.any(0))
        width = int(used.max()) + 1 if len(used) else 1
        if width == self.width:
            return self
        return TrainBatch(self.input_ids[:, :width], self.attention_mask[:, :width], self.loss_mask[:, :width],
                          {k: v[:, :width] if v.dim() == 2 and v.shape[1] == self.width else v
                           for k, v in self.extras.items()})

    def packed_rows(self, max_tokens: int, max_rows: int | None = None) -> list[torch.Tensor]:
        """Row indices of micro-batches packed by length: rows sorted longest first, each micro-batch
        filled while its rows x its longest row stay within `max_tokens` (and its rows within `max_rows`).

        A row longer than `max_tokens` gets a micro-batch of its own. Neighbours in length share a
        micro-batch, so trimmed to its longest row it carries little padding.
        """
        lengths = self.lengths.clamp(min=1).tolist()
        order = sorted(range(self.size), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
        return [torch.tensor(g, dtype=torch.long)
                for g in pack_by_width([(lengths[i], i, [i]) for i in order], max_tokens, max_rows)]

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       pad_id: int = 0, **extras: torch.Tensor) -> "TrainBatch":
        """Right-padded prompt+response rows, the loss mask on the response tokens."""
        rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            n = len(p) + len(r)
            ids[i, :n] = torch.tensor(rows[i], dtype=torch.long)
            attn[i, :n] = 1
            mask[i, len(p):n] = 1
        return cls(ids, attn, mask, dict(extras))


def pack_by_width(units: Sequence[tuple[int, object, list[int]]], max_tokens: int,
                  max_rows: int | None = None) -> list[list[int]]:
    """Micro-batches of `units` (width, key, rows), given widest first: each filled while its units x its first
    (widest) unit's width stay within `max_tokens`, its rows within `max_rows`, and no two of its units share a
    key; a unit wider than `max_tokens` gets a micro-batch of its own. Returns each micro-batch's rows, in order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    out: list[list[int]] = []
    width = 0
    held: set = set()  # the keys of the last micro-batch's units
    for w, key, rows in units:
        if (out and key not in held and (len(held) + 1) * width <= max_tokens
                and (not max_rows or len(out[-1]) + len(rows) <= max_rows)):
            out[-1] += rows
            held.add(key)
        else:
            out.append(list(rows))
            width, held = w, {key}
    return out


@dataclass
class PolicyOutput:
    """Per-token log-probabilities (and entropies when asked) of a batch under the model."""

    logprobs: torch.Tensor  # [B, T]
    entropy: torch.Tensor | None = None  # [B, T]
    values: torch.Tensor | None = None  # [B, T], engines with a value head


#: (policy output, micro-batch) -> (loss, metrics); a metric is a float or a 0-d tensor, which an engine may read
#: after the last micro-batch (`float()` takes either), so that no micro-batch waits on the host
LossFn = Callable[[PolicyOutput, TrainBatch], "tuple[torch.Tensor, dict[str, float | torch.Tensor]]"]


def nll_loss(out: PolicyOutput, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens (supervised fine-tuning); reports their mean entropy."""
    mask = batch.loss_mask
    loss = -(out.logprobs * mask).sum() / mask.sum().clamp(min=1)
    ent = float((out.entropy.detach() * mask).sum() / mask.sum().clamp(min=1)) if out.entropy is not None else 0.0
    return loss, {"entropy": ent}


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False) -> PolicyOutput:
    """Log-probabilities of `input_ids` under next-token `logits` [B, T, V], aligned with the tokens
    (float32, without a float32 copy of the logits: gearshift.logprobs)."""
    b, t, v = logits.shape
    # position t predicts token t + 1; the last position's target is a stand-in, dropped below
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    picked, ent = picked_logprobs(logits.reshape(b * t, v), targets.reshape(-1), with_entropy=with_entropy)
    zero = picked.new_zeros(b, 1)
    out = PolicyOutput(torch.cat([zero, picked.view(b, t)[:, :-1]], dim=1))
    if with_entropy:
        out.entropy = torch.cat([zero, ent.view(b, t)[:, :-1]], dim=1)
    return out


class TrainEngine(Buildable, ABC):
    """A trainer of one causal LM over a mesh of ranks; names of weights are Hugging Face names.

    Subclass it (or `gearshift.module_train.ModuleTrainEngine`, which does most of the work
    for a trainer built on a torch module and takes its layout as a `gearshift.sharding.Sharding`),
    declare `Options`, implement
    `__init__(self, args, options)` (call `super().__init__(args, options)`, set `device`) and
    the abstract methods below.
    """

    Args: ClassVar[type] = TrainArgs
    #: the engine's tensors stay whole and valid between exports, so a rollout engine may serve from
    #: them (False for an engine that gathers its weights only while exporting, as ZeRO-3 does)
    can_lend_weights: ClassVar[bool] = True
    #: rank of the LoRA adapter the engine trains (`export_adapter`); 0: it trains every weight
    lora_rank: int = 0

    args: TrainArgs
    device: torch.device
    mesh: MeshSpec
    #: the dtype forward and backward compute in, when below the weights' (None: `args.dtype`'s)
    compute_dtype: torch.dtype | None = None
    #: the last train step's micro-batches were sized by the device memory free then, smaller than they would
    #: be with more of it: the hybrid actor then puts the rollout engine to sleep during training, whatever fits
    memory_bound: bool = False

    @abstractmethod
    def weight_spec(self) -> WeightSpec:
        """Every trainable weight: full shape, dtype, and placement on the train mesh; a tied head as an alias."""

    @abstractmethod
    def local_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """This rank's shards of `names` in the train layout, without communication (views are fine)."""

    def materialized(self, names: list[str]) -> AbstractContextManager:
        """Entered around each bucket of an export, before `local_weights(names)`, until the bucket is consumed.

        An engine whose weights are not addressable shard by shard (ZeRO-3's flat
        partitions) gathers `names` here and lets go on exit, so an export holds one bucket
        at a time. Every rank enters it for every bucket in the same order (it may be a
        collective). Default: nothing to do.
        """
        return nullcontext()

    def export_adapter(self) -> Adapter | None:
        """The LoRA adapter this engine trains, whole on every rank (None: it trains no adapter).

        Every rank calls it (it may gather). The adapter sync (`AdapterResharder`) hands it to a
        rollout engine that serves adapters, instead of the merged weights `gearshift.reshard.export_weights` gives.
        """
        return None

    @abstractmethod
    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        """Log-probabilities of the batch's tokens (values, for a `value_head` engine), without a graph."""

    @abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the batch, micro-batched as configured.

        Returns at least `loss` (the loss over the whole batch: micro-batch losses weighted
        by their share of the sequences), `grad_norm` (the global norm before clipping, over
        every shard) and `lr`, plus the metrics `loss_fn` returns, likewise weighted. Metrics
        are averaged over the ranks: every rank returns the same dict.
        """

    def state_bytes(self) -> dict[str, int]:
        """Device bytes each tag (params, grads, optimizer) holds now, for the memory plan of a switch; an
        optimizer that allocates its state at the first step counts it as it will be. Default: {} (unknown:
        the plan then moves optimizer and grads every switch)."""
        return {}

    def reserve_host(self, tags: Sequence[str]) -> int:
        """Allocate now the host memory `offload(tags)` will copy into, so the first switch runs at the speed
        of the next; returns the host bytes held. Default: nothing to reserve (0)."""
        return 0

    @abstractmethod
    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """Move the tagged state (params, grads, optimizer) to host memory; returns bytes moved (0 when the
        state lives in host memory already, as on a CPU)."""

    @abstractmethod
    def onload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """Bring offloaded state back bit-exactly; returns bytes moved."""

    @abstractmethod
    def save(self, path: str) -> None:
        """Write a resumable checkpoint (model and optimizer) under the folder `path`; every rank calls it."""

    @abstractmethod
    def load(self, path: str) -> None:
        """Restore what `save` wrote."""

    @abstractmethod
    def save_hf(self, path: str) -> None:
        """Write a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads; every rank calls it."""

    def close(self) -> None:
        """Release the engine's resources."""


__all__ = ["LossFn", "PolicyOutput", "TRAIN_TAGS", "TrainArgs", "TrainBatch", "TrainEngine", "check_tags",
           "nll_loss", "pack_by_width", "token_logprobs"]
