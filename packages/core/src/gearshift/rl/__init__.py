"""The RL loop on top of the kernel: config, controller, algorithms, rewards, data, built-in tasks,
metrics and checkpoints.

    from gearshift.rl import Trainer

    Trainer(model="path/to/model", reward="my_rewards.py:score", dataset="train.jsonl").train()

Importing it (or any module of it) registers the built-in tasks' models with `gearshift.models`
(`presets`), so that `resolve_model("small-add")` and `resolve_model("tiny-add-rm")` build them;
`gearshift.rl.resolve_model` is that same function, for code that imports it from here to be sure of it.
"""

from ..models import resolve_model
from . import presets  # noqa: F401 - registers '<preset>-<task>' and '<preset>-<task>-rm' with gearshift.models
from .config import Config, ConfigError, load_config
from .run import Trainer

__all__ = ["Config", "ConfigError", "Trainer", "load_config", "resolve_model"]
