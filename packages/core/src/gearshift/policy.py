"""A causal LM module's forward to what a trainer takes its loss of: per-token log-probabilities, or values.

`policy_forward` runs any module that takes `input_ids`, `attention_mask` and
`position_ids` (a Hugging Face causal LM, or `ValueHeadModel` around one, sharded
or not); positions count only real tokens, so left and right padding give the
same result.
"""

from __future__ import annotations

import torch
from torch import nn

from . import shared_prefix
from .train import PolicyOutput, TrainBatch, token_logprobs


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left and right padding give the same logits."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class ValueHeadModel(nn.Module):
    """The causal LM's decoder, then a linear map of each position's last hidden state to a value (PPO's critic)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=next(lm.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)  # start from value 0 everywhere: no bias in early advantages
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kw) -> torch.Tensor:
        hidden = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
        ).last_hidden_state
        return self.value_head(hidden)[..., 0].float().clone()  # not a view: FSDP hooks need a tensor of its own


def policy_forward(model: nn.Module, batch: TrainBatch, with_entropy: bool = False,
                   value_head: bool = False, layout: "shared_prefix.Layout | None" = None,
                   mask_kind: str = "bool") -> PolicyOutput:
    """`model`'s log-probabilities of the batch's tokens (entropies when asked), or, for a `ValueHeadModel`
    (`value_head`), its values, aligned like log-probabilities. `batch` is on the model's device.

    With a `layout` (gearshift.shared_prefix), the model runs the batch's rows packed by prompt, under a 4-D
    attention mask of `mask_kind` (`shared_prefix.MASK_KINDS`), and the log-probabilities come back per row."""
    if layout is not None:
        if value_head:
            raise ValueError("shared prompts compute log-probabilities only, not a critic's values")
        lay = layout.to(batch.input_ids.device)
        out = model(input_ids=lay.input_ids, attention_mask=lay.attention_mask(mask_kind),
                    position_ids=lay.position_ids, use_cache=False)
        return shared_prefix.logprobs(out.logits, lay, batch.input_ids, with_entropy)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids(batch.attention_mask), use_cache=False)
    if value_head:  # a critic: values instead of log-probabilities
        # aligned like logprobs: values[:, t] is the value of the state token t is chosen in, i.e. of the
        # prefix before it; the head's output at t has already seen token t, so it moves one to the right
        values = torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)
        return PolicyOutput(torch.zeros_like(values), values=values)
    return token_logprobs(out.logits, batch.input_ids, with_entropy)


__all__ = ["ValueHeadModel", "policy_forward", "position_ids"]
