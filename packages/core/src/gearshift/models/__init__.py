"""Models built locally, never downloaded: tiny random causal LMs of several architectures and random reward
models, plus the task models that the RL loop registers here.

    path = resolve_model("tiny")         # a preset, built once under $GEARSHIFT_CACHE (~/.cache/gearshift)
    path = resolve_model("tiny-gpt2")    # the same size in another architecture
    path = resolve_model("tiny-rm")      # a reward model of the 'tiny' shape, random weights

    import gearshift.rl                  # registers the built-in tasks' models (`gearshift.rl.presets`):
    path = resolve_model("small-add")    # the 'small' preset after a format warm-up on the 'add' task
    path = resolve_model("tiny-add-rm")  # a reward model: the 'tiny' shape taught the 'add' task's reward

This package knows nothing of the RL loop: a task's models are built by the
code that knows the task, which hands its two builders to
`register_task_models` when it is imported (`gearshift.rl` does so for its
built-in tasks).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .reward import build_reward_model, train_reward_model
from .tiny import ARCHS, BF16_PRESETS, PRESETS, build_model, build_tokenizer

#: (the folder to build in, the preset's name) -> the folder, built once (a folder of the same recipe is reused)
Builder = Callable[[Path, str], str]


@dataclass(frozen=True)
class TaskModels:
    """How one task's models are built from a preset: the causal LM '<preset>-<task>' and the reward model
    '<preset>-<task>-rm'."""

    policy: Builder
    reward: Builder


#: task name -> its builders, filled by `register_task_models`
TASK_MODELS: dict[str, TaskModels] = {}


def register_task_models(task: str, policy: Builder, reward: Builder) -> None:
    """Make '<preset>-<task>' and '<preset>-<task>-rm' resolvable for every preset; registering a task again
    replaces its builders."""
    if not task or "-" in task or task in ARCHS or task == "rm":
        raise ValueError(f"task name {task!r} would make model names ambiguous: it must be non-empty, without "
                         f"'-', and neither 'rm' nor an architecture ({list(ARCHS)})")
    TASK_MODELS[task] = TaskModels(policy, reward)


def resolve_model(model: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A model path as given, or a preset built on first use under the cache folder.

    Presets: 'tiny', 'small', 'bench100m', 'qwen2-0.5b' (random weights, Qwen2 architecture);
    '<preset>-<arch>' for another architecture ('tiny-gpt2', 'tiny-llama', ...); '<preset>-rm', a reward
    model (`AutoModelForSequenceClassification`, one output) with random weights. Once a task has
    registered its models (`register_task_models`; `import gearshift.rl` registers the built-in tasks):
    '<preset>-<task>' such as 'small-add', the preset after a short format warm-up on the task, and
    '<preset>-<task>-rm', a reward model taught to predict the task's reward (see `gearshift.rl.presets`).
    """
    if os.path.isdir(model):
        return model
    if not known_model(model):
        raise ValueError(unknown_model(model))
    root = Path(cache_dir or os.environ.get("GEARSHIFT_CACHE", Path.home() / ".cache" / "gearshift")) / "models"
    folder = root / f"{model}-{hashlib.sha1(model.encode()).hexdigest()[:8]}"
    with _only_builder(folder):
        return _resolve_preset(model, folder)


@contextlib.contextmanager
def _only_builder(folder: Path) -> Iterator[None]:
    """One process at a time builds (or checks) a preset's folder: jobs started together on a fresh cache
    (ranks under torchrun, runs side by side) would otherwise read files another is still writing."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _resolve_preset(model: str, folder: Path) -> str:
    if model in PRESETS:
        return build_model(folder, preset=model, dtype="bfloat16" if model in BF16_PRESETS else "float32")
    preset, _, suffix = model.rpartition("-")
    if suffix == "rm":
        base, _, task = preset.rpartition("-")
        if preset in PRESETS:
            return build_reward_model(folder, preset)
        if base in PRESETS and task in TASK_MODELS:
            return TASK_MODELS[task].reward(folder, base)
    if preset in PRESETS and suffix in ARCHS:
        return build_model(folder, preset=preset, arch=suffix)
    if preset in PRESETS and suffix in TASK_MODELS:
        return TASK_MODELS[suffix].policy(folder, preset)
    raise ValueError(unknown_model(model))


def known_model(model: str) -> bool:
    """Whether `resolve_model` takes `model` (a folder or a preset name), without building anything."""
    if os.path.isdir(model) or model in PRESETS:
        return True
    preset, _, suffix = model.rpartition("-")
    if suffix == "rm":
        base, _, task = preset.rpartition("-")
        return preset in PRESETS or (base in PRESETS and task in TASK_MODELS)
    return preset in PRESETS and (suffix in ARCHS or suffix in TASK_MODELS)


def unknown_model(model: str) -> str:
    """The error for a name `known_model` refuses: what there is, and, while no task has registered its
    models, where the task models come from."""
    tasks = (f"'<preset>-<task>' and '<preset>-<task>-rm' with a task from {sorted(TASK_MODELS)}" if TASK_MODELS else
             "task models ('<preset>-<task>' such as 'small-add', '<preset>-<task>-rm') once the RL loop has "
             "registered them: `import gearshift.rl` first, or use `gearshift.rl.resolve_model`")
    return (f"model {model!r} is neither a folder nor a preset; presets: {sorted(PRESETS)}, "
            f"'<preset>-<arch>' with an architecture from {list(ARCHS)}, reward models '<preset>-rm', and {tasks}")


__all__ = ["ARCHS", "PRESETS", "TASK_MODELS", "TaskModels", "build_model", "build_reward_model", "build_tokenizer",
           "known_model", "register_task_models", "resolve_model", "train_reward_model", "unknown_model"]
