"""Ulysses sequence parallelism for a Hugging Face causal LM (DeepSpeed-Ulysses's layout).

The sp ranks of a group are given the same batch; each runs the model on its
slice of every sequence (length / sp consecutive tokens), so activations,
logits and the MLP's work are split along the length. Attention needs every
token: around it an all-to-all turns [tokens / sp, all heads] into [all tokens,
heads / sp], the model's own attention runs on that, and a second all-to-all
turns it back. The attention mask of the whole sequence (causal, padding) is
made once per batch and passed in as a prepared 4-D mask, which transformers
hands to every layer as it is; a batch without padding goes with none, sdpa's
causal flag saying it all.

Each rank then gathers the per-token log-probabilities (or values) of the whole
batch, a few numbers per token, and computes the loss on all of them, the same
on every rank of the group; the gather's backward keeps each rank's own slice,
so a rank's gradients are exactly its tokens' share, and FSDP adds them up over
sp (its divide factor is dp alone). Lengths that do not divide by sp are padded
at the end (masked, cut off again before the loss).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from gearshift.logprobs import picked_logprobs
from gearshift.module_train import position_ids
from gearshift.train import PolicyOutput, TrainBatch
from torch import nn

from gearshift.mesh import MeshError

#: inner attention implementations the wrapper runs on the gathered sequence, and the mask each takes
INNER = ("sdpa", "eager")
_names = itertools.count()


def check_heads(config, *, sp: int, tp: int = 1) -> None:
    """Raise a `MeshError` unless each tp rank's query and key/value heads divide by `sp`."""
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and (heads % tp or (heads // tp) % sp):
            raise MeshError(f"sp={sp} (with tp={tp}) must divide the model's {key}={heads} per tp rank "
                            f"({heads // tp if heads % tp == 0 else heads / tp}): sequence parallelism gives each "
                            f"rank whole heads; use an sp that divides them, or sp=1")


def split_length(length: int, sp: int) -> int:
    """Tokens per rank; a `MeshError` unless `length` divides by `sp` (pad it first: `padded_width`)."""
    if length % sp:
        raise MeshError(f"a sequence of {length} tokens does not split over sp={sp} ranks: pad it to "
                        f"{padded_width(length, sp)} tokens")
    return length // sp


def padded_width(width: int, sp: int) -> int:
    return -(-width // sp) * sp


class _AllToAll(torch.autograd.Function):
    """Cut `x` into sp chunks on `scatter_dim`, send chunk i to rank i, join what arrives on `gather_dim`."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    chunks = x.movedim(scatter_dim, 0)
    chunks = chunks.reshape(size, chunks.shape[0] // size, *chunks.shape[1:]).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    # received[i] is rank i's chunk: rank i's slice of the gathered dimension
    parts = [part.movedim(0, scatter_dim) for part in received.unbind(0)]
    return torch.cat(parts, dim=gather_dim)


class _GatherLength(torch.autograd.Function):
    """Every rank's [B, T / sp] slice joined into [B, T]; the gradient keeps this rank's slice only.

    Every rank of the group computes the same loss from the joined tensor, so the gradient
    each receives is the same: its own slice of it is its tokens' share, nothing to add up.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        start = dist.get_rank(ctx.group) * ctx.width
        return grad[:, start:start + ctx.width].contiguous(), None


def gather_length(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherLength.apply(x, group)


def ulysses_attention(inner, group):
    """An attention function for transformers' `AttentionInterface`: all-to-all, `inner` on every token of a
    slice of the heads, all-to-all back."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("sliding_window"):
            raise MeshError("sequence parallelism does not cut sliding-window attention: use sp=1 for this model")
        # [B, heads, T / sp, d] -> [B, heads / sp, T, d]
        query, key, value = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
        out, weights = inner(module, query, key, value, attention_mask, **kwargs)
        # out is [B, T, heads / sp, d] -> [B, T / sp, heads, d]
        return _AllToAll.apply(out, group, 1, 2), None

    return attention


def use_ulysses_attention(hf_model: nn.Module, group) -> str:
    """Register the Ulysses attention over `group` (the sp ranks) around the model's own implementation, and
    switch the model to it; returns its name in transformers' `AttentionInterface`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    inner_name = hf_model.config._attn_implementation or "eager"
    if inner_name not in INNER:
        raise MeshError(f"sequence parallelism runs the attention implementations {INNER}; the model uses "
                        f"{inner_name!r}: load it with attn_implementation='sdpa'")
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise MeshError(f"{type(hf_model).__name__} does not call transformers' attention interface, so sequence "
                        f"parallelism cannot wrap its attention: use sp=1 for this model")
    inner = eager_attention_forward if inner_name == "eager" else ALL_ATTENTION_FUNCTIONS[inner_name]
    name = f"gearshift_ulysses_{inner_name}_{next(_names)}"
    AttentionInterface.register(name, ulysses_attention(inner, group))
    # the model is given the whole sequence's mask ready-made, or none (causal, no padding: see `forward`);
    # a mask made from this rank's slice alone would be wrong, so none is ever made
    AttentionMaskInterface.register(name, _no_mask)
    _INNER[name] = inner_name
    hf_model.config._attn_implementation = name
    return name


#: name of each registered Ulysses attention -> the implementation it wraps (which decides the mask's form)
_INNER: dict[str, str] = {}


def _no_mask(*args, **kwargs):
    return None


def full_mask(attention_mask: torch.Tensor, inner: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T]: causal, padding keys masked; a padding query sees itself (no empty row, no NaN)."""
    width = attention_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
    keep = keep | torch.eye(width, dtype=torch.bool, device=attention_mask.device)[None, None]
    if inner == "sdpa":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def forward(model: nn.Module, batch: TrainBatch, sp_mesh, with_entropy: bool, value_head: bool = False) -> PolicyOutput:
    """The policy's per-token outputs of `batch` (whole, on every rank of `sp_mesh`), computed on this rank's
    slice of the length; aligned like `gearshift.train.token_logprobs`."""
    group, sp = sp_mesh.get_group(), sp_mesh.size()
    rank = dist.get_rank(group)
    width = batch.width
    wide = padded_width(width, sp)
    ids = nn.functional.pad(batch.input_ids, (0, wide - width + 1))  # one more: the last slice's next token
    attn = nn.functional.pad(batch.attention_mask, (0, wide - width))
    local = split_length(wide, sp)
    start, stop = rank * local, (rank + 1) * local
    dtype = next(model.parameters()).dtype
    inner = _INNER.get(model.config._attn_implementation, "sdpa")
    # without padding, sdpa is told the attention is causal and takes no mask: its fused kernels keep no
    # [T, T] scores, as the model's own does for such a batch
    mask = None if inner == "sdpa" and bool(attn[:, :width].all()) and wide == width else full_mask(attn, inner, dtype)
    out = model(input_ids=ids[:, start:stop], attention_mask=mask, position_ids=position_ids(attn)[:, start:stop],
                use_cache=False)
    if value_head:  # values[:, t]: the value of the prefix before token t, as the one-process engine aligns them
        values = gather_length(out, group)[:, :width]
        values = torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)
        return PolicyOutput(torch.zeros_like(values), values=values)
    b, t, v = out.logits.shape
    picked, ent = picked_logprobs(out.logits.reshape(b * t, v), ids[:, start + 1:stop + 1].reshape(-1),
                                  with_entropy=with_entropy)  # log p(token t+1 | up to t)
    picked = picked.view(b, t)
    zero = picked.new_zeros(picked.shape[0], 1)
    result = PolicyOutput(torch.cat([zero, gather_length(picked, group)[:, :width - 1]], dim=1))
    if with_entropy:
        ent = ent.view(b, t)
        result.entropy = torch.cat([zero, gather_length(ent, group)[:, :width - 1]], dim=1)
    return result
