"""Micro-batching a train batch, as pure functions (verl's `rearrange_micro_batches` is the model).

`micro_batch_rows` decides which rows go together: consecutive runs of
`max_rows`, or rows packed by length under a token budget. `even_out` makes the
count what every rank of a sharded model must run (the most any rank has):
the largest groups split in two, and fillers (None) where rows run out.
`select_micro_batches` cuts the batch accordingly. None of them communicates;
the engine finds the count over its ranks and passes it in.
"""

from __future__ import annotations

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


__all__ = ["even_out", "micro_batch_rows", "select_micro_batches"]
