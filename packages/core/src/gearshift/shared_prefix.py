"""Shared prompts: the rows of a batch that begin with the same prompt computed with that prompt once.

GRPO samples n answers per prompt, and a trainer that runs each row as its own
sequence computes every prompt n times, forward and backward. Here the rows of
one prompt become one packed sequence: the prompt, then each row's own tokens
(its answer, or a whole episode after the prompt), with positions restarting
after the prompt for each row, and an attention mask in which each row's tokens
see the prompt and their own row only. Every token then sees exactly what it
saw in its own row, so log-probabilities and gradients are the same up to float
rounding (the prompt's gradient is the sum over its rows, as before).

`layout` plans one micro-batch, `packed_micro_batches` makes the micro-batches
(a prompt's rows kept together, under a token budget), and `logprobs` maps the
packed sequences' logits back to the batch's rows. The prompt of a row is what
comes before its first trained token (`loss_mask`); a row with nothing
trained, or none before it, shares nothing. The mask is a 4-D one, which
Hugging Face models take in place of their own for the `sdpa` and `eager`
attention implementations (`MASK_KINDS`); flash-attention kernels take none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import picked_logprobs
from .train import PolicyOutput, TrainBatch, pack_by_width

#: attention implementations that take a 4-D mask from the caller, and the mask each takes
MASK_KINDS = {"sdpa": "bool", "eager": "additive"}

#: the widest packed sequence (its mask is width x width)
MAX_WIDTH = 4096


def sliding_window(config) -> int | None:
    """The window of a model config's sliding-window attention layers, None when no layer has one (a 4-D mask
    given to a Hugging Face model replaces the window it would apply)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if any("sliding" in str(t) for t in types) else None
    return window if getattr(config, "use_sliding_window", True) else None


def prompt_lengths(batch: TrainBatch) -> list[int]:
    """Each row's prompt: its tokens before the first trained one (0 where it has none or is not right-padded)."""
    real = batch.attention_mask.long()
    lengths = real.sum(-1)
    # rows whose real tokens are not the first of the row (left padding) share nothing
    right_padded = (real.cumsum(-1).gather(-1, (lengths - 1).clamp(min=0)[:, None])[:, 0] == lengths) & (lengths > 0)
    trained = batch.loss_mask > 0
    first = trained.float().argmax(-1)  # the first trained token (0 in a row with none)
    return torch.where(right_padded & trained.any(-1), first, 0).tolist()


def prompt_groups(batch: TrainBatch, prompts: list[int] | None = None) -> list[list[int]]:
    """Rows with the same prompt, in first-seen order (a row that shares nothing is a group of its own)."""
    prompts = prompt_lengths(batch) if prompts is None else prompts
    groups: dict[object, list[int]] = {}
    ids = batch.input_ids
    for r, p in enumerate(prompts):
        key = (p, tuple(ids[r, :p].tolist())) if p else ("row", r)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def split(rows: list[int], prompt: int, lengths: list[int], cap: int | None,
          max_rows: int | None = None) -> list[list[int]]:
    """A prompt's rows in packed sequences of at most `cap` tokens (and `max_rows` rows): longest first,
    filled in order; a row too long for `cap` with the prompt goes alone."""
    rows = sorted(rows, key=lambda r: -lengths[r])
    out: list[list[int]] = []
    width = 0
    for r in rows:
        own = lengths[r] - prompt
        if out and (cap is None or width + own <= cap) and (not max_rows or len(out[-1]) < max_rows):
            out[-1].append(r)
            width += own
        else:
            out.append([r])
            width = prompt + own
    return out


def prompt_packs(batch: TrainBatch, lengths: list[int], cap: int | None = None,
                 max_rows: int | None = None) -> list[tuple[int, int, list[int]]]:
    """`batch`'s packed sequences as (prompt length, prompt group, rows): each prompt's rows `split` under `cap`
    tokens (and `max_rows` rows), prompts in first-seen order."""
    prompts = prompt_lengths(batch)
    packs = []
    for g, group in enumerate(prompt_groups(batch, prompts)):
        p = prompts[group[0]]
        packs += [(p, g, rows) for rows in split(group, p, lengths, cap, max_rows)]
    return packs


#: the packed rows' 4-D mask costs passes of its own over every (query, key) pair: on a CPU the packed rows of
#: the calc task cost 1.3x what the FLOPs alone give
MASK_OVERHEAD = 1.5


def pair_cost(config) -> float:
    """One (query, key) pair's attention in units of one token through the model, from a Hugging Face config
    (QK and AV products against the projections, MLP and head; backward scales both alike), mask passes
    included (`MASK_OVERHEAD`)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inner = getattr(config, "intermediate_size", None) or 4 * h
    mlp = 3 if getattr(config, "hidden_act", "gelu") in ("silu", "swiglu") else 2  # gated MLPs: three matrices
    token = 2 * (2 * h * heads * head_dim + 2 * h * kv + mlp * h * inner) + 2 * h * config.vocab_size / max(
        getattr(config, "num_hidden_layers", 1), 1)
    return MASK_OVERHEAD * 4 * heads * head_dim / token


def sharing_pays(batch: TrainBatch, config, cap: int | None = None) -> bool:
    """Whether packing `batch`'s rows by prompt computes less than running them apart: it saves the repeated
    prompts' tokens and costs attention over the packed sequences (each row's keys become the whole sequence's,
    quadratic in its width): short prompts before long answers run faster apart."""
    lengths = batch.lengths.tolist()
    alpha = pair_cost(config)
    apart = sum(n + alpha * n * n for n in lengths)
    widths = [packed_width(rows, p, lengths) for p, _, rows in prompt_packs(batch, lengths, cap)]
    return sum(w + alpha * w * w for w in widths) < apart


def packed_width(rows: list[int], prompt: int, lengths: list[int]) -> int:
    return prompt + sum(lengths[r] - prompt for r in rows)


@dataclass
class Layout:
    """One micro-batch's rows packed by prompt: what the model runs, and where each row's tokens lie in it."""

    input_ids: torch.Tensor  # [G, W]
    position_ids: torch.Tensor  # [G, W]
    segments: torch.Tensor  # [G, W]: 0 the prompt, k the k-th row's own tokens, -1 padding
    index: torch.Tensor  # [B, T]: each row's token t at index[r, t] of the packed tokens, flattened
    computed: int  # positions the model computes (G x W)
    real: int  # of them, tokens (the rest is padding)

    def attention_mask(self, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[G, 1, W, W]: a token sees the earlier tokens of the prompt and of its own row (padding sees
        itself); bool (True: attend) or additive (0 or the dtype's lowest)."""
        seg = self.segments
        width = seg.shape[1]
        q = torch.arange(width, device=seg.device)
        causal = q[None, :] <= q[:, None]
        same = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0)
        allowed = (causal & same) | torch.eye(width, dtype=torch.bool, device=seg.device)
        allowed = allowed[:, None]
        if kind == "bool":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(~allowed,
                                                                                       torch.finfo(dtype).min)

    def to(self, device: torch.device | str) -> "Layout":
        return Layout(self.input_ids.to(device), self.position_ids.to(device), self.segments.to(device),
                      self.index.to(device), self.computed, self.real)


def layout(batch: TrainBatch, cap: int | None = None) -> Layout:
    """`batch`'s rows packed by prompt, sequences of at most `cap` tokens (a prompt's rows split among several
    when needed; a row longer than `cap` alone)."""
    lengths = batch.lengths.tolist()
    packs = [(p, rows) for p, _, rows in prompt_packs(batch, lengths, cap)]  # (prompt length, rows)
    widths = [packed_width(rows, p, lengths) for p, rows in packs]
    width = max(max(widths), 1)
    count, (size, row_width) = len(packs), batch.input_ids.shape
    ids = torch.zeros(count, width, dtype=torch.long)
    pos = torch.zeros(count, width, dtype=torch.long)
    seg = torch.full((count, width), -1, dtype=torch.long)
    index = torch.zeros(size, row_width, dtype=torch.long)
    src = batch.input_ids
    for g, (p, rows) in enumerate(packs):
        base = g * width
        ids[g, :p] = src[rows[0], :p]
        pos[g, :p] = torch.arange(p)
        seg[g, :p] = 0
        start = p
        for k, r in enumerate(rows, start=1):
            own = lengths[r] - p
            ids[g, start:start + own] = src[r, p:lengths[r]]
            pos[g, start:start + own] = torch.arange(p, lengths[r])
            seg[g, start:start + own] = k
            index[r, :p] = base + torch.arange(p)
            index[r, p:lengths[r]] = base + start + torch.arange(own)
            start += own
    return Layout(ids, pos, seg, index, count * width, sum(widths))


def logprobs(logits: torch.Tensor, lay: Layout, input_ids: torch.Tensor, with_entropy: bool = False) -> PolicyOutput:
    """The batch's log-probabilities (and entropies) from the packed sequences' `logits` [G, W, V], aligned
    like `train.token_logprobs`'s: position 0 holds 0; padding positions hold a finite value of no meaning."""
    before = lay.index[:, :-1]  # the token each one is predicted after, in the packed sequences
    picked, ent = picked_logprobs(logits.flatten(0, 1), input_ids[:, 1:].reshape(-1), before.reshape(-1),
                                  with_entropy)
    zero = picked.new_zeros(before.shape[0], 1)
    out = PolicyOutput(torch.cat([zero, picked.view(before.shape)], dim=1))
    if with_entropy:
        out.entropy = torch.cat([zero, ent.view(before.shape)], dim=1)
    return out


def packed_micro_batches(batch: TrainBatch, max_tokens: int, max_rows: int | None = None,
                         cap: int | None = None) -> list[torch.Tensor]:
    """Row indices of micro-batches whose packed sequences (each of at most `cap` tokens, default
    `max_tokens`) fit `max_tokens` together (sequences x the widest), at most `max_rows` rows each: a
    prompt's rows stay together as far as the budget lets them, neighbours in width share a micro-batch, and
    a micro-batch holds at most one sequence of a prompt, so that `layout` packs it as planned here."""
    cap = min(cap or max_tokens, max_tokens)
    lengths = batch.lengths.clamp(min=1).tolist()
    packs = [(packed_width(rows, p, lengths), g, rows) for p, g, rows in prompt_packs(batch, lengths, cap, max_rows)]
    packs.sort(key=lambda x: -x[0])  # stable
    # the prompt is each unit's key: a micro-batch holds one packed sequence of a prompt, as `layout` makes it
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in pack_by_width(packs, max_tokens, max_rows)]


__all__ = ["Layout", "MASK_KINDS", "MASK_OVERHEAD", "MAX_WIDTH", "layout", "logprobs", "packed_micro_batches",
           "pair_cost", "prompt_groups", "prompt_lengths", "prompt_packs", "sharing_pays", "sliding_window", "split"]
