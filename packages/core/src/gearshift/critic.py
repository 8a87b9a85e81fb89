"""A value head on any `AutoModelForCausalLM`: the critic of PPO."""

from __future__ import annotations

import torch
from torch import nn


class ValueHeadModel(nn.Module):
    """The causal LM's decoder, then a linear map of each position's last hidden state to a value."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(lm.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)  # start from value 0 everywhere: no bias in early advantages
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kw) -> torch.Tensor:
        hidden = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
        ).last_hidden_state
        return self.value_head(hidden)[..., 0].float().contiguous()

    def save_pretrained(self, path: str, **kw) -> None:
        from safetensors.torch import save_file

        kw.pop("state_dict", None)
        self.lm.save_pretrained(path, **kw)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  f"{path}/value_head.safetensors")
