"""Reward models built locally: an `AutoModelForSequenceClassification` with one output, random or trained.

    path = build_reward_model("/tmp/rm", preset="tiny")              # random weights: scores mean nothing
    path = build_reward_model("/tmp/rm", preset="tiny", task="add")  # taught to predict the task's reward

A task-trained model learns, by regression, the task's own rule reward of
prompt + completion texts (right answers, wrong answers, junk), so its score
of a completion is about 1 when the rule says right and about 0 otherwise: a
learned reward whose scores can be checked against the rule. The folder loads
through `AutoModelForSequenceClassification` like any Hugging Face reward model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .tiny import PRESETS, _config, build_tokenizer


def _completions(answer: str, answers: list[str], rng: random.Random) -> list[str]:
    """Completions of one prompt as a policy might write them: right, wrong, and malformed."""
    wrong = rng.choice([a for a in answers if a != answer] or ["0"])
    junk = rng.choice(["X", "=", "+", "a", "?", " "]) + rng.choice([answer, wrong])
    return [answer, answer, wrong, str(rng.randint(0, 99)), junk, answer + rng.choice(["", " ", "."])]


def task_examples(task: str, n: int, seed: int = 0, **task_options) -> list[tuple[str, str, float]]:
    """(prompt, completion, the task's reward) for `n` rows of `task`, several completions per row."""
    from ..rl.rewards import load_reward
    from ..rl.tasks import TASK_REWARDS, make_task

    rows = make_task(task, n, seed=seed, **task_options)
    answers = sorted({r["answer"] for r in rows})
    reward = load_reward(TASK_REWARDS[task])
    rng = random.Random(seed)
    out = []
    for row in rows:
        extra = {k: v for k, v in row.items() if k != "prompt"}
        for completion in _completions(row["answer"], answers, rng):
            out.append((row["prompt"], completion, float(reward(completion, **extra))))
    return out


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


def build_reward_model(path: str | Path, preset: str = "tiny", arch: str = "qwen2", *, task: str | None = None,
                       steps: int = 800, seed: int = 0, **task_options) -> str:
    """Build (once; a folder with the same recipe is reused) a one-output sequence classifier with the
    preset's shape and the byte tokenizer; with `task`, trained to predict that task's reward."""
    from transformers import AutoModelForSequenceClassification

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    path = Path(path)
    recipe = json.dumps({"preset": preset, "arch": arch, "task": task, "steps": steps, "seed": seed,
                         "task_options": task_options, "reward": _task_reward(task), "v": 1}, sort_keys=True)
    stamp = path / "gearshift-recipe.json"
    if stamp.exists() and stamp.read_text() == recipe:
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    tokenizer.padding_side = "right"
    config = _config(arch, PRESETS[preset](), tokenizer, "float32")
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        if task is not None:
            train_reward_model(model, tokenizer, task_examples(task, 2000, seed=seed + 1, **task_options),
                               steps=steps, seed=seed)
    model.save_pretrained(str(path), safe_serialization=True)
    stamp.write_text(recipe)
    return str(path)


def _task_reward(task: str | None) -> str | None:
    from ..rl.tasks import TASK_REWARDS

    return TASK_REWARDS.get(task) if task else None


__all__ = ["build_reward_model", "task_examples", "train_reward_model"]
