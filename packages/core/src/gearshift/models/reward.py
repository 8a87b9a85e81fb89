"""Reward models built locally: an `AutoModelForSequenceClassification` with one output, random or trained.

    path = build_reward_model("/tmp/rm", preset="tiny")  # random weights: scores mean nothing
    path = build_reward_model("/tmp/rm", preset="tiny", train=fit, recipe={"data": "..."})  # fit(model, tokenizer)

`train_reward_model` fits the model's score of prompt + completion to a
reward by regression; the RL loop's task reward models (`tiny-add-rm`,
`gearshift.rl.presets`) are this fit to a task's rule reward. The folder
loads through `AutoModelForSequenceClassification` like any Hugging Face
reward model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import torch

from .tiny import PRESETS, _config, build_tokenizer


def train_reward_model(model, tokenizer, examples: list[tuple[str, str, float]], *, steps: int, batch_size: int = 64,
                       lr: float = 2e-3, seed: int = 0) -> float:
    """Fit the model's score of prompt + completion to each example's reward (squared error); returns the
    last batch's loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        enc = tokenizer([p + c for p, c, _ in batch], return_tensors="pt", padding=True)
        target = torch.tensor([r for _, _, r in batch])
        score = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0]
        loss = torch.nn.functional.mse_loss(score.float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def build_reward_model(path: str | Path, preset: str = "tiny", arch: str = "qwen2", *, seed: int = 0,
                       train: Callable[[Any, Any], object] | None = None, recipe: dict | None = None) -> str:
    """Build (once; a folder with the same recipe is reused) a one-output sequence classifier with the
    preset's shape and the byte tokenizer; `train(model, tokenizer)`, when given, fits it before it is saved,
    and `recipe` (JSON, not empty) says what that fit depends on, so that another fit builds the folder again."""
    from transformers import AutoModelForSequenceClassification

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    base = {"preset": preset, "arch": arch, "seed": seed, "v": 1}
    if (train is None) != (not recipe):
        raise ValueError("pass train= and recipe= together: the recipe says what the training depends on")
    if set(base) & set(recipe or {}):
        raise ValueError(f"recipe keys {sorted(set(base) & set(recipe))} are the model's own; name them otherwise")
    path = Path(path)
    wanted = json.dumps({**base, **(recipe or {})}, sort_keys=True)
    stamp = path / "gearshift-recipe.json"
    if stamp.exists() and stamp.read_text() == wanted:
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    tokenizer.padding_side = "right"
    config = _config(arch, PRESETS[preset](), tokenizer, "float32")
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        if train is not None:
            train(model, tokenizer)
    model.save_pretrained(str(path), safe_serialization=True)
    stamp.write_text(wanted)
    return str(path)


__all__ = ["build_reward_model", "train_reward_model"]
