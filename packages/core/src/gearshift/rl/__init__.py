"""The RL loop on top of the kernel: config, controller, algorithms, rewards, data, built-in tasks,
metrics and checkpoints.

    from gearshift.rl import Trainer

    Trainer(model="path/to/model", reward="my_rewards.py:score", dataset="train.jsonl").train()
"""

from .config import Config, ConfigError, load_config
from .run import Trainer

__all__ = ["Config", "ConfigError", "Trainer", "load_config"]
