"""`gearshift train` and the Python API.

    from gearshift import Trainer

    Trainer(model="path/to/model", reward="rewards.py:score", dataset="train.jsonl").train()
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping


from .config import Config, build_config, load_config


class Trainer:
    """A run from a model, a reward and a dataset; anything else comes from the config defaults.

    `model` is a path or preset, or the whole model section
    (`{"path": ..., "lora": {"r": 8}}`); `reward` is a callable
    `(completion, **row) -> float | None`, its name ('module:fn', 'file.py:fn'),
    or the whole reward section (`{"model": "path/to/rm", "weights": [1, 0.5]}`);
    `dataset` a jsonl/parquet path or a `PromptDataset`; `sections` override
    config sections, e.g. `algorithm={"name": "ppo"}, run={"steps": 100}`.
    """

    def __init__(self, model: str | Mapping | None = None, reward: str | Callable | Mapping | None = None,
                 dataset: Any = None, config: Config | None = None, **sections: dict) -> None:
        extra: dict = {k: dict(v) for k, v in sections.items()}
        if isinstance(model, Mapping):
            extra.setdefault("model", {}).update(model)
        elif model is not None:
            extra.setdefault("model", {})["path"] = model
        if isinstance(reward, Mapping):
            extra.setdefault("reward", {}).update(reward)
        elif isinstance(reward, str):
            extra.setdefault("reward", {})["fn"] = reward
        if isinstance(dataset, str):
            extra.setdefault("data", {})["path"] = dataset
        self.config = build_config(config, extra)
        self._reward = reward if callable(reward) else None
        self._dataset = None if isinstance(dataset, str) else dataset
        self.controller = None

    def train(self) -> list[dict]:
        """Run every step; returns the metrics of each."""
        if self.config.run.placement == "split":
            from .split import SplitController as Controller
        else:
            from .controller import Controller

        self.controller = Controller(self.config, reward_fn=self._reward, dataset=self._dataset)
        return self.controller.fit()

    def save(self, path: str) -> None:
        """Write the trained policy as a Hugging Face folder."""
        if self.controller is None:
            raise RuntimeError("call train() first")
        self.controller.export(path)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (optional; defaults train the built-in task)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. algorithm.name=ppo rollout.backend=vllm run.steps=100")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--export", metavar="DIR", help="write the final policy as a Hugging Face folder")


def train_command(args: argparse.Namespace) -> int:
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:  # only overrides were given
        path, overrides = None, [path, *overrides]
    cfg = load_config(path, overrides)
    if args.print_config:
        print(cfg.to_yaml())
        return 0
    trainer = Trainer(config=cfg)
    history = trainer.train()
    controller = trainer.controller
    if controller.rank == 0 and history:
        first, last = history[0], history[-1]
        print(f"reward/mean: first step {first['reward/mean']:.3f}, last step {last['reward/mean']:.3f}")
        print(f"metrics: {controller.logger.path}; reward curve: {controller.out / 'reward.png'}")
    if args.export:
        trainer.save(args.export)
        if controller.rank == 0:
            print(f"policy written to {args.export}")
    return 0
