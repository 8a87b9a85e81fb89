"""Models built locally, never downloaded: tiny random causal LMs of several architectures, and the
format-warmed models of the built-in tasks.

    path = resolve_model("tiny")         # a preset, built once under $GEARSHIFT_CACHE (~/.cache/gearshift)
    path = resolve_model("tiny-gpt2")    # the same size in another architecture
    path = resolve_model("small-add")    # the 'small' preset after a format warm-up on the 'add' task
    path = resolve_model("tiny-add-rm")  # a reward model: the 'tiny' shape taught the 'add' task's reward
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path
from typing import Iterator

from .reward import build_reward_model
from .tiny import ARCHS, BF16_PRESETS, PRESETS, build_model, build_tokenizer


def resolve_model(model: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A model path as given, or a preset built on first use under the cache folder.

    Presets: 'tiny', 'small', 'bench100m', 'qwen2-0.5b' (random weights, Qwen2 architecture);
    '<preset>-<arch>' for another architecture ('tiny-gpt2', 'tiny-llama', ...); and
    '<preset>-<task>' such as 'small-add': the preset after a short format warm-up on a
    built-in task (see `gearshift.models.warmup`). Reward models (`AutoModelForSequenceClassification`,
    one output): '<preset>-rm' (random weights) and '<preset>-<task>-rm', taught to predict the
    task's reward (see `gearshift.models.reward`).
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
    from ..rl.tasks import TASKS

    if model in PRESETS:
        return build_model(folder, preset=model, dtype="bfloat16" if model in BF16_PRESETS else "float32")
    preset, _, suffix = model.rpartition("-")
    if suffix == "rm":
        base, _, task = preset.rpartition("-")
        if preset in PRESETS:
            return build_reward_model(folder, preset)
        if base in PRESETS and task in TASKS:
            from .warmup import TASK_MODEL_OPTIONS

            return build_reward_model(folder, base, task=task, **TASK_MODEL_OPTIONS.get(task, {}))
    if preset in PRESETS and suffix in ARCHS:
        return build_model(folder, preset=preset, arch=suffix)
    if preset in PRESETS and suffix in TASKS:
        from .warmup import TASK_MODEL_OPTIONS, build_task_model

        return build_task_model(folder, preset, suffix, **TASK_MODEL_OPTIONS.get(suffix, {}))
    raise ValueError(unknown_model(model))


def known_model(model: str) -> bool:
    """Whether `resolve_model` takes `model` (a folder or a preset name), without building anything."""
    from ..rl.tasks import TASKS

    if os.path.isdir(model) or model in PRESETS:
        return True
    preset, _, suffix = model.rpartition("-")
    if suffix == "rm":
        base, _, task = preset.rpartition("-")
        return preset in PRESETS or (base in PRESETS and task in TASKS)
    return preset in PRESETS and (suffix in ARCHS or suffix in TASKS)


def unknown_model(model: str) -> str:
    from ..rl.tasks import TASKS

    return (f"model {model!r} is neither a folder nor a preset; presets: {sorted(PRESETS)}, "
            f"'<preset>-<arch>' with an architecture from {list(ARCHS)}, or '<preset>-<task>' with a task from "
            f"{sorted(TASKS)}; reward models '<preset>-rm' and '<preset>-<task>-rm'")


__all__ = ["ARCHS", "PRESETS", "build_model", "build_reward_model", "build_tokenizer", "known_model", "resolve_model"]
