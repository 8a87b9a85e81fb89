"""Statistics over the masked (response) tokens of a [B, T] tensor, and loss aggregation.

Padding and prompt tokens must not move a mean, a variance or a loss, so every
reduction here takes the mask.
"""

from __future__ import annotations

import torch

#: how a [B, T] per-token loss becomes a scalar
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; 0 where nothing is masked in (instead of nan)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over the masked entries (Bessel-corrected by default, as `torch.var`)."""
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = masked_sum((x - mean) ** 2, mask)
    return var / (count - 1).clamp(min=1) if unbiased else var / count.clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """`x` scaled to unit variance (and zero mean unless `shift_mean=False`) over the masked entries.

    Entries outside the mask come out 0, so they cannot leak into a loss.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
              tokens_per_seq: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token `losses` [B, T] to a scalar.

    token_mean: sum over masked tokens / number of masked tokens (long answers weigh more).
    seq_mean_token_sum: each sequence's sum, averaged over sequences.
    seq_mean_token_mean: each sequence's mean, averaged over sequences (every answer weighs the same).

    `tokens_per_seq` [B] (each entry the mean number of masked tokens per
    sequence over the whole step batch) makes `token_mean` divide by the
    step's token count instead of this micro-batch's: a trainer that weighs
    micro-batch losses by their share of sequences then sums to exactly the
    token mean of the whole batch.
    """
    mask = mask.to(losses.dtype)
    if mode == "token_mean":
        if tokens_per_seq is None:
            return masked_mean(losses, mask)
        return masked_sum(losses, mask) / (tokens_per_seq.to(losses.dtype).sum()).clamp(min=1e-8)
    if mode == "seq_mean_token_sum":
        return masked_sum(losses, mask, dim=-1).mean()
    if mode == "seq_mean_token_mean":
        return masked_mean(losses, mask, dim=-1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")


def check_aggregation(mode: str) -> str:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")
    return mode


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last masked token of each row; -1 for a row with none."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
