"""`gearshift train` and the Python API.

    from gearshift import Trainer

    Trainer(model="path/to/model", reward="rewards.py:score", dataset="train.jsonl").train()
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Mapping

from . import checkpoint
from .config import Config, ConfigError, build_config, load_config


class Trainer:
    """A run from a model, a reward and a dataset; anything else comes from the config defaults.

    `model` is a path or preset, or the whole model section
    (`{"path": ..., "lora": {"r": 8}}`); `reward` is a callable
    `(completion, **row) -> float | None`, its name ('module:fn', 'file.py:fn'),
    or the whole reward section (`{"model": "path/to/rm", "weights": [1, 0.5]}`);
    `dataset` a jsonl/parquet path, a `datasets.Dataset`, a list of row mappings
    (each with a prompt column) or a `PromptDataset`; `eval_dataset` the same for
    a held-out set, evaluated every `run.eval_every` steps and at the end;
    `sections` override config sections, e.g. `algorithm={"name": "ppo"}, run={"steps": 100}`.
    """

    def __init__(self, model: str | Mapping | None = None, reward: str | Callable | Mapping | None = None,
                 dataset: Any = None, config: Config | None = None, eval_dataset: Any = None,
                 **sections: dict) -> None:
        extra: dict = {k: dict(v) for k, v in sections.items()}
        if isinstance(model, Mapping):
            extra.setdefault("model", {}).update(model)
        elif model is not None:
            extra.setdefault("model", {})["path"] = model
        if isinstance(reward, Mapping):
            extra.setdefault("reward", {}).update(reward)
        elif isinstance(reward, str):
            extra.setdefault("reward", {})["fn"] = reward
        for key, given in (("path", dataset), ("val_path", eval_dataset)):
            if isinstance(given, (str, os.PathLike)):
                extra.setdefault("data", {})[key] = str(given)
        self.config = build_config(config, extra)
        self._reward = reward if callable(reward) else None
        self._dataset = None if isinstance(dataset, (str, os.PathLike)) else dataset
        self._eval_dataset = None if isinstance(eval_dataset, (str, os.PathLike)) else eval_dataset
        self.controller = None

    def train(self) -> list[dict]:
        """Run every step; returns the metrics of each."""
        if self.config.run.placement == "split":
            from .split import SplitController as Controller
        else:
            from .controller import Controller

        if self._eval_dataset is not None and self.config.run.placement == "split":
            raise ConfigError("eval_dataset: held-out evaluation runs with run.placement=colocated")
        extra = {"eval_dataset": self._eval_dataset} if self._eval_dataset is not None else {}
        self.controller = Controller(self.config, reward_fn=self._reward, dataset=self._dataset, **extra)
        return self.controller.fit()

    def close(self) -> None:
        """Release the engines of the last `train()` (GPU memory, engine processes); `save` is no longer possible."""
        if self.controller is not None:
            self.controller.close()
            self.controller = None

    def save(self, path: str) -> None:
        """Write the trained policy as a Hugging Face folder."""
        if self.controller is None:
            raise RuntimeError("call train() first")
        self.controller.export(path)


def check_config(cfg: Config) -> str:
    """Everything about a run that can be checked without building it: the config's values over this world,
    the backends installed and the options given them, the model a folder or known preset, every row of the
    data files, the reward function and the algorithm's registered parts. Raises on a problem."""
    from ..models import known_model, unknown_model
    from .data import read_rows
    from .engines import check_options
    from .learner import check_algorithm
    from .rewards import load_reward

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world, reward_given=False)
    check_options(cfg)  # the backends installed, and given only options they have
    for key, model in (("model.path", cfg.model.path), ("reward.model", cfg.reward.model)):
        if model and not known_model(model):
            raise ConfigError(f"{key}: {unknown_model(model)}")
    if cfg.episodes():  # a tool or environment that does not load
        from .agent import load_environment, load_tools

        load_tools(cfg.agent.tools)
        if cfg.agent.environment:
            load_environment(cfg.agent.environment)
    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{key}={path!r}: no such file")
        if path:
            read_rows(path, prompt_key=cfg.data.prompt_key)  # every row parsed, its prompt checked
    rule = cfg.reward_rule()
    if rule:
        load_reward(rule)
    check_algorithm(cfg)
    pools = cfg.run.pools
    where = (f"split over {pools.train} train and {pools.rollout} rollout workers" if cfg.run.placement == "split"
             else f"colocated on {world} rank{'s' if world > 1 else ''}")
    return (f"gearshift train: the configuration can run: {cfg.algorithm.name} with {cfg.rollout.backend} rollout "
            f"and {cfg.train.backend} training, {where}, model {cfg.model.path}")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (optional; defaults train the built-in task)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. algorithm.name=ppo rollout.backend=vllm run.steps=100")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config, each key with its help, and exit")
    parser.add_argument("--check", action="store_true",
                        help="check that the config can run (keys, values, backends and their options, model, "
                             "data rows, reward, algorithm) and exit")
    parser.add_argument("--export", metavar="DIR", help="write the final policy as a Hugging Face folder")


def train_command(args: argparse.Namespace) -> int:
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:  # only overrides were given
        path, overrides = None, [path, *overrides]
    cfg = load_config(path, overrides)
    if args.print_config:
        print(cfg.to_yaml(comments=True), end="")
        return 0
    if args.check:
        print(check_config(cfg))
        return 0
    trainer = Trainer(config=cfg)
    try:
        return _train(trainer, args)
    except BaseException as err:  # Ctrl-C: say where the run stood and how to go on, not a traceback from an engine
        if not _ctrl_c(err):
            raise
        if trainer.controller is None or trainer.controller.rank == 0:
            print(_interrupted(trainer.controller), file=sys.stderr, flush=True)
        return 130
    finally:
        trainer.close()  # the engines go before the process group they share (else their finalizers fail at exit)


def _train(trainer: Trainer, args: argparse.Namespace) -> int:
    history = trainer.train()
    controller = trainer.controller
    if controller.rank == 0 and history:
        first, last = history[0], history[-1]
        print(f"reward/mean: first step {first['reward/mean']:.3f}, last step {last['reward/mean']:.3f}")
        plot = f"; reward curve: {controller.plot_path}" if controller.plot_path else ""
        print(f"metrics: {controller.logger.path}{plot}")
    if args.export:
        trainer.save(args.export)
        if controller.rank == 0:
            print(f"policy written to {args.export}")
    return 0


def _ctrl_c(err: BaseException | None) -> bool:
    """Whether `err` is Ctrl-C's KeyboardInterrupt or wraps one: torch's distributed checkpoint turns one
    raised while it writes into a `CheckpointException` holding it among its `failures`."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, KeyboardInterrupt):
            return True
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict) and any(
                _ctrl_c(f[0] if isinstance(f, tuple) else f) for f in failures.values() if f is not None):
            return True
        err = err.__cause__ or err.__context__
    return False


def _interrupted(controller) -> str:
    if controller is None:
        return "gearshift train: interrupted before the first step"
    last = checkpoint.latest(controller.out / "checkpoints")
    where = (f"the last checkpoint is {last}, and the same command resumes there (run.resume=auto)" if last
             else "no checkpoint was written yet (run.checkpoint_every sets how often)")
    if last and last.name == f"step_{controller.step:06d}":  # held until the step's checkpoint was written
        return f"gearshift train: interrupted after step {controller.step}; {where}"
    return f"gearshift train: interrupted in step {controller.step + 1}; {where}"
