"""A trainer's shared prompts (gearshift.shared_prefix): whether they apply, the check on the first forward,
each micro-batch's plan and layout. `ModuleTrainEngine` holds one `PromptSharing`.

They apply when `train.share_prompts` asks (None: on a CPU, for a batch where packing computes less than
running its rows apart: `shared_prefix.sharing_pays`) and nothing refuses them: a critic, a sharding
whose forward takes no packed rows (FSDP under Ulysses), an attention implementation that takes no 4-D mask,
a sliding window the mask would replace. The first forward runs two rows of one prompt packed and apart
and compares them, every rank at once: a model that applies a mask of its own instead of the one given, or
whose forward refuses a 4-D mask (Bloom's reads it as 2-D), turns sharing off with a warning, or, when it was
asked for, stops with an error.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import dist as gdist
from .mesh import MeshSpec
from .micro_batch import micro_batch_rows
from .shared_prefix import (MASK_KINDS, MAX_WIDTH, Layout, layout, packed_micro_batches, sharing_pays,
                            sliding_window)
from .train import TrainBatch


class PromptSharing:
    """Shared prompts for one engine's model (its Hugging Face `config`) laid out by `sharding` over `mesh`."""

    def __init__(self, asked: bool | None, config, sharding, *, value_head: bool, compute_dtype: torch.dtype,
                 mesh: MeshSpec) -> None:
        self.asked, self.config, self.sharding, self.value_head, self.mesh = asked, config, sharding, value_head, mesh
        self.tolerance = 1e-3 if compute_dtype.itemsize >= 4 else 0.1  # logprobs, packed against apart
        #: None until the first forward has checked the model, then whether packed rows gave the rows' own
        self.holds: bool | None = None
        self.cap: int | None = None  # the widest packed sequence of the micro-batches planned last
        #: the sharding's forward takes packed rows (one whose forward lacks the parameters is taken as not)
        self.takes_layout = sharding.shares_prompts and "layout" in inspect.signature(sharding.forward).parameters
        if asked:
            refused = self.refused()
            if refused:
                raise ValueError(f"train.share_prompts=true, but {refused}: set train.share_prompts=false (or leave "
                                 f"it unset)")

    def refused(self) -> str | None:
        """Why this engine cannot share prompts, or None."""
        if self.value_head:
            return "a critic's values are computed row by row"
        if not self.takes_layout:
            return f"{type(self.sharding).__name__}'s forward does not take rows packed by prompt"
        kind = getattr(self.config, "_attn_implementation", None)
        if kind not in MASK_KINDS:
            return f"the model's attention implementation {kind!r} takes no 4-D mask (one of {sorted(MASK_KINDS)} does)"
        window = sliding_window(self.config)
        if window:
            return (f"the model attends through a sliding window of {window} tokens, which the packed rows' mask "
                    f"would replace")
        return None

    def on(self, device: torch.device) -> bool:
        """Whether micro-batches on `device` run their rows packed by prompt now."""
        if self.asked is False or self.holds is False or (self.asked is None and device.type != "cpu"):
            return False
        return self.refused() is None

    @property
    def mask_kind(self) -> str:
        return MASK_KINDS[self.config._attn_implementation]

    def pays(self, batch: TrainBatch, budget: int | None) -> bool:
        """Whether `batch` runs packed by prompt: always when asked; left to us, when that computes less."""
        return bool(self.asked) or sharing_pays(batch, self.config, min(budget or MAX_WIDTH, MAX_WIDTH))

    def micro_batches(self, batch: TrainBatch, budget: int | None, max_rows: int | None) -> list[torch.Tensor]:
        """Rows of each micro-batch: under a token budget, packed sequences of whole prompts; else runs of rows."""
        self.cap = min(budget or MAX_WIDTH, MAX_WIDTH)
        if budget:
            return packed_micro_batches(batch, budget, max_rows, cap=self.cap)
        return micro_batch_rows(batch, max_rows=max_rows)

    def layout(self, batch: TrainBatch, model: nn.Module, device: torch.device) -> Layout | None:
        """`batch`'s rows packed by prompt when two rows or more share one (the model checked first)."""
        if self.holds is None:
            self.check(batch, model, device)
        if not self.holds:
            return None
        if not self.pays(batch, self.cap):
            return None
        lay = layout(batch, self.cap)
        return lay if lay.input_ids.shape[0] < batch.size else None

    @torch.no_grad()
    def check(self, batch: TrainBatch, model: nn.Module, device: torch.device) -> None:
        """Run two rows of one prompt (from `batch`'s first row) packed and apart, once; sets `holds`."""
        row = batch.input_ids[0, :int(batch.lengths[0])]
        ok, gap, refused = True, None, None
        if len(row) >= 2:
            p = max(1, len(row) // 2)
            pair = TrainBatch.from_sequences([row[:p].tolist()] * 2, [row[p:].tolist(), row[p:].flip(0).tolist()])
            pair = pair.to(device)
            was = model.training
            model.eval()
            try:
                apart = self.sharding.forward(model, pair, False, False).logprobs
                try:
                    packed = self.sharding.forward(model, pair, False, False, layout=layout(pair),
                                                   mask_kind=self.mask_kind).logprobs
                except (ValueError, RuntimeError, TypeError, IndexError) as err:  # e.g. Bloom reads a 2-D mask
                    refused = f"{type(err).__name__}: {err}"
            finally:
                model.train(was)
                self.sharding.release(model)
            ok = refused is None
            if ok:
                gap = float((apart - packed).abs().mul(pair.attention_mask).max())
                ok = gap <= self.tolerance
        if self.mesh.world_size > 1 and gdist.is_distributed():  # every rank decides alike
            flag = torch.tensor([1 if ok else 0], device=gdist.collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        self.holds = ok
        if not ok:
            if refused:
                what = f"the model's forward refused the packed rows' 4-D attention mask ({refused})"
            elif gap is not None and gap > self.tolerance:
                what = (f"the model's log-probabilities differ by {gap:.3g} between two rows of one prompt run "
                        f"apart and packed")
            else:
                what = "another rank's check failed"
            if self.asked:
                raise ValueError(f"train.share_prompts=true, but {what}: the model does not take the packed "
                                 f"rows' attention mask; set train.share_prompts=false")
            warnings.warn(f"shared prompts turned off: {what}", stacklevel=3)


__all__ = ["PromptSharing"]
