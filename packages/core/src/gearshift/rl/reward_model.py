"""A learned reward: a sequence classifier with one output scores each prompt + completion.

    rm = RewardModel("path/to/rm", device=torch.device("cpu"))
    rm.score(["3+1="], ["4"])        # -> [0.98]

The model is any `AutoModelForSequenceClassification` with one label in a
local folder (the presets `tiny-rm` and `tiny-add-rm` are small ones). It runs
on the training device in batches, and between uses its weights wait in
host memory (`HostStash`, as a trainer's offloaded state does), so it takes
no device memory while the rollout engine or the trainer needs it.

What it reads: a chat prompt (a list of messages) goes through the reward
model's own chat template with the completion as the assistant's turn; a text
prompt is followed by the completion, as the policy saw them. Long inputs lose
their start, not the completion.

`combine` mixes it with a rule reward by weights (`reward.weights`: [fn, model]).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..hf import dropout_keys, own_storage
from ..offload import HostStash


class RewardModelError(ValueError):
    """A reward model that cannot score: not a one-output sequence classifier, no tokenizer, no padding token."""


class RewardModel:
    """Scores completions with a one-output `AutoModelForSequenceClassification`, batched, on `device`."""

    def __init__(self, path: str, *, device: torch.device, dtype: torch.dtype = torch.float32,
                 batch_size: int = 32, max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise RewardModelError(f"reward model batch size {batch_size} must be >= 1")
        try:
            config = AutoConfig.from_pretrained(path)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise RewardModelError(f"reward model {path!r}: not a Hugging Face folder with a config and a "
                                   f"tokenizer ({err})") from None
        if getattr(config, "num_labels", None) != 1:
            raise RewardModelError(f"reward model {path!r} has {getattr(config, 'num_labels', None)} outputs; a "
                                   f"reward model scores with one (num_labels=1)")
        for key in dropout_keys(config):
            setattr(config, key, 0.0)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise RewardModelError(f"reward model {path!r}: its tokenizer has no padding or end token to "
                                       f"pad a batch with")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config.pad_token_id = self.tokenizer.pad_token_id  # the score is read at each row's last real token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype)
        own_storage(self.model)
        self.model.to(device).eval().requires_grad_(False)
        self.path, self.device, self.batch_size = path, device, batch_size
        self.max_length = max_length or getattr(config, "max_position_embeddings", None) or \
            self.tokenizer.model_max_length
        self._stash = HostStash()
        self.offload()

    def texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[str]:
        """What the model reads for each pair: chat prompts through its chat template, text prompts as they are."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str):
                out.append(prompt + completion)
            elif self.tokenizer.chat_template is None:
                raise RewardModelError(f"reward model {self.path!r} has no chat template for a chat prompt")
            else:
                messages = [*prompt, {"role": "assistant", "content": completion}]
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return out

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        """One score per (prompt, completion), batched; the weights come to the device for the call only."""
        texts = self.texts(prompts, completions)
        self.onload()
        try:
            scores: list[float] = []
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length)
                logits = self.model(input_ids=enc["input_ids"].to(self.device),
                                    attention_mask=enc["attention_mask"].to(self.device)).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
            return scores
        finally:
            self.offload()

    def offload(self) -> int:
        """Move the weights to host memory (nothing moves when they live there already); returns bytes moved."""
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers()) if t.device.type != "cpu"]
        return self._stash.offload(tensors) if tensors and not len(self._stash) else 0

    def onload(self) -> int:
        return self._stash.restore()

    def close(self) -> None:
        self._stash.close()
        self.model = None


def combine(rule: Sequence[float | None] | None, learned: Sequence[float] | None,
            weights: Sequence[float]) -> list[float | None]:
    """weights[0] x the rule reward + weights[1] x the model's score, per sample; a sample the rule drops
    (None) stays dropped. Either source may be absent."""
    if rule is None and learned is None:
        raise ValueError("combine needs a rule reward, a reward model's scores, or both")
    if rule is not None and learned is not None and len(rule) != len(learned):
        raise ValueError(f"{len(rule)} rule rewards but {len(learned)} reward-model scores")
    w_rule, w_model = weights
    n = len(rule) if rule is not None else len(learned)
    out: list[float | None] = []
    for i in range(n):
        r = rule[i] if rule is not None else 0.0
        out.append(None if r is None else w_rule * r + (w_model * learned[i] if learned is not None else 0.0))
    return out


__all__ = ["RewardModel", "RewardModelError", "combine"]
