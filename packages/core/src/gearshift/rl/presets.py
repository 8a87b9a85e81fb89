"""The built-in tasks' models, registered with `gearshift.models` when the RL loop is imported.

    import gearshift.rl                             # or any module of it: this one is imported with the package
    from gearshift.models import resolve_model

    resolve_model("small-add")    # the 'small' preset after a format warm-up on 'add' (`warmup.build_task_model`)
    resolve_model("tiny-add-rm")  # the 'tiny' shape taught the 'add' task's rule reward (`build_task_reward_model`)

The models package builds random models and knows nothing of tasks; the
models made from a task (its prompts, its answers, its reward, the tool
episodes of its agent) are built here, by the layer that owns the tasks,
and handed to `gearshift.models.register_task_models` by name.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..models import build_reward_model, register_task_models, train_reward_model
from .tasks import TASK_REWARDS, TASKS, make_task


def _completions(answer: str, answers: list[str], rng: random.Random) -> list[str]:
    """Completions of one prompt as a policy might write them: right, wrong, and malformed."""
    wrong = rng.choice([a for a in answers if a != answer] or ["0"])
    junk = rng.choice(["X", "=", "+", "a", "?", " "]) + rng.choice([answer, wrong])
    return [answer, answer, wrong, str(rng.randint(0, 99)), junk, answer + rng.choice(["", " ", "."])]


def task_examples(task: str, n: int, seed: int = 0, **task_options) -> list[tuple[str, str, float]]:
    """(prompt, completion, the task's reward) for `n` rows of `task`, several completions per row."""
    from .rewards import load_reward

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


def build_task_reward_model(path: str | Path, preset: str, task: str, *, steps: int = 800, seed: int = 0,
                            **task_options) -> str:
    """A reward model of the preset's shape trained (once; the same recipe is reused) to predict `task`'s rule
    reward of prompt + completion: right, wrong and malformed completions of 2000 of its rows, by regression."""
    if task not in TASK_REWARDS:
        raise ValueError(f"task {task!r} has no rule reward to learn; tasks with one: {sorted(TASK_REWARDS)}")

    def fit(model, tokenizer) -> None:
        examples = task_examples(task, 2000, seed=seed + 1, **task_options)
        train_reward_model(model, tokenizer, examples, steps=steps, seed=seed)

    recipe = {"task": task, "task_options": task_options, "reward": TASK_REWARDS[task], "steps": steps}
    return build_reward_model(path, preset, seed=seed, train=fit, recipe=recipe)


def _policy(task: str):
    def build(folder: Path, preset: str) -> str:
        from .warmup import TASK_MODEL_OPTIONS, build_task_model  # torch and the trainer only when one is built

        return build_task_model(folder, preset, task, **TASK_MODEL_OPTIONS.get(task, {}))
    return build


def _reward(task: str):
    def build(folder: Path, preset: str) -> str:
        from .warmup import TASK_MODEL_OPTIONS

        return build_task_reward_model(folder, preset, task, **TASK_MODEL_OPTIONS.get(task, {}))
    return build


def register() -> None:
    """Register every built-in task's models with `gearshift.models` (done on import; again is harmless)."""
    for task in TASKS:
        register_task_models(task, policy=_policy(task), reward=_reward(task))


register()

__all__ = ["build_task_reward_model", "register", "task_examples"]
