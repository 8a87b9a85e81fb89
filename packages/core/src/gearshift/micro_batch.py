"""Micro-batching a train batch, as pure functions (verl's `rearrange_micro_batches` is the model).

`micro_batch_rows` decides which rows go together: consecutive runs of
`max_rows`, or rows packed by length under a token budget. `even_out` makes the
count what every rank of a sharded model must run (the most any rank has):
the largest groups split in two, and fillers (None) where rows run out.
`select_micro_batches` cuts the batch accordingly. None of them communicates;
the engine finds the count over its ranks and passes it in. `sum_metrics` adds the
micro-batches' metrics up once the last has run, reading them from the device at once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .train import TrainBatch


def micro_batch_rows(batch: TrainBatch, *, max_rows: int | None = None,
                     max_tokens: int | None = None) -> list[torch.Tensor]:
    """Row indices of each micro-batch: with `max_tokens`, rows packed longest first while rows x the
    longest row stay within it (`TrainBatch.packed_rows`, at most `max_rows` rows each); else consecutive
    runs of `max_rows` rows (None: the whole batch in one)."""
    if max_tokens:
        return batch.packed_rows(max_tokens, max_rows)
    size = max_rows or batch.size
    return [torch.arange(start, min(start + size, batch.size)) for start in range(0, batch.size, size)]


def even_out(groups: list[torch.Tensor], count: int) -> list[torch.Tensor | None]:
    """`groups` grown to `count` micro-batches: the largest split in two while one has two rows or more,
    then None for each still missing (a filler: a forward and backward of one row that counts for nothing)."""
    groups = list(groups)
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        rows = groups[largest]
        if len(rows) < 2:
            break
        half = (len(rows) + 1) // 2
        groups[largest:largest + 1] = [rows[:half], rows[half:]]
    return groups + [None] * (count - len(groups))


def select_micro_batches(batch: TrainBatch, groups: list[torch.Tensor | None],
                         trim: bool = False) -> list[tuple[TrainBatch, torch.Tensor | None]]:
    """Each micro-batch with the rows it holds (None for a filler: the batch's first row). `trim`: each cut to
    its longest row (packed rows); else a contiguous slice as wide as the batch."""
    out: list[tuple[TrainBatch, torch.Tensor | None]] = []
    for rows in groups:
        if rows is None:
            out.append((batch.select(slice(0, 1)), None))
        elif trim:
            out.append((batch.select(rows).trimmed(), rows))
        else:
            out.append((batch.select(slice(int(rows[0]), int(rows[-1]) + 1)), rows))
    return out


def sum_metrics(seen: Sequence[tuple[str, Any, float, bool]]) -> dict[str, float]:
    """The batch's metrics from each micro-batch's (key, value, weight, real): a weighted sum, or for a key
    ending in `_max` the largest over the real micro-batches (a filler's count as nothing; 0.0 when a rank has
    fillers only). Values may be floats or tensors on a device: the tensors are read in one transfer."""
    tensors = [v for _, v, _, _ in seen if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else [])
    totals: dict[str, float] = {}
    for key, value, weight, real in seen:
        value = next(read) if isinstance(value, torch.Tensor) else float(value)
        if key.endswith("_max"):  # an extreme over the micro-batches, not a weighted sum
            totals[key] = max(totals.get(key, float("-inf")), value if real else float("-inf"))
        else:
            totals[key] = totals.get(key, 0.0) + value * weight
    return {k: (0.0 if v == float("-inf") else v) for k, v in totals.items()}


__all__ = ["even_out", "micro_batch_rows", "select_micro_batches", "sum_metrics"]
