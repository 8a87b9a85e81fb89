"""Run configuration: typed dataclasses are the one source of truth.

A YAML file fills them, then dotted overrides from the command line
(`rollout.backend=vllm train.lr=1e-5`); `validate()` checks everything up
front and says what to change.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot run, with what to change."""


@dataclass
class ModelConfig:
    path: str = "small-add"  # a folder, or a preset built locally ('tiny', 'small', 'small-add', ...)
    dtype: str = "float32"


@dataclass
class DataConfig:
    path: str | None = None  # jsonl or parquet with a 'prompt' column; None: the built-in task
    task: str = "add"  # built-in task when path is None
    task_options: dict[str, Any] = field(default_factory=lambda: {"digits": 1, "second": 1})
    prompt_key: str = "prompt"
    max_prompt_len: int = 64
    seed: int = 0


@dataclass
class RolloutConfig:
    backend: str = "vllm"
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 4
    stop: list[str] = field(default_factory=list)
    mesh: str = ""  # e.g. 'dp=2'; empty: dp = world size
    options: dict[str, Any] = field(default_factory=dict)  # passed to the engine


@dataclass
class TrainConfig:
    backend: str = "fsdp"
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mini_batch_size: int = 0  # sequences per optimizer step; 0: the whole batch in one step
    micro_batch_size: int = 0  # sequences per forward/backward; 0: the whole mini-batch
    mesh: str = ""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # grpo | ppo
    advantage: str = ""  # default: grpo for grpo, gae for ppo
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    epochs: int = 1  # passes over each batch
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in: str = "loss"  # loss | reward
    entropy_coef: float = 0.0
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    critic_lr: float = 1e-4
    value_clip: float = 0.2


@dataclass
class RewardConfig:
    fn: str = "gearshift.rl.rewards:numeric_match"  # 'module:fn' or 'path/to/file.py:fn'


@dataclass
class RunConfig:
    steps: int = 120
    prompts_per_step: int = 32
    seed: int = 0
    output_dir: str = "runs/default"
    checkpoint_every: int = 40  # 0: never
    resume: str = "auto"  # auto | never | a checkpoint folder
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gearshift"
    samples_per_step: int = 2  # completions printed each step
    plot: bool = True
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world_size: int = 1) -> "Config":
        """Raise `ConfigError` listing every problem and what to change."""
        from ..mesh import MeshError, MeshSpec

        problems: list[str] = []
        a, r, t, run = self.algorithm, self.rollout, self.train, self.run
        if a.name not in ("grpo", "ppo"):
            problems.append(f"algorithm.name={a.name!r}: use 'grpo' or 'ppo'")
        if a.name == "grpo" and r.n < 2:
            problems.append(f"rollout.n={r.n}: GRPO compares samples of one prompt, so use n >= 2")
        if a.kl_in not in ("loss", "reward"):
            problems.append(f"algorithm.kl_in={a.kl_in!r}: use 'loss' or 'reward'")
        advantage = a.advantage or ("gae" if a.name == "ppo" else "grpo")
        if a.kl_in == "reward" and a.kl_coef > 0 and advantage in ("grpo", "rloo"):
            problems.append(f"algorithm.kl_in=reward needs per-token rewards, which {advantage} does not take: "
                            f"set algorithm.kl_in=loss, or use advantage gae/reinforce")
        batch = run.prompts_per_step * r.n
        for key, size in (("train.mini_batch_size", t.mini_batch_size), ("train.micro_batch_size", t.micro_batch_size)):
            if size < 0:
                problems.append(f"{key}={size} must be >= 0")
        if t.mini_batch_size and batch % t.mini_batch_size:
            problems.append(
                f"train.mini_batch_size={t.mini_batch_size} does not divide the batch of "
                f"run.prompts_per_step x rollout.n = {batch} sequences")
        if t.mini_batch_size and t.mini_batch_size % r.n:
            problems.append(f"train.mini_batch_size={t.mini_batch_size} must be a multiple of rollout.n={r.n} "
                            f"so that each GRPO group stays in one mini-batch")
        if t.micro_batch_size and (t.mini_batch_size or batch) % t.micro_batch_size:
            problems.append(f"train.micro_batch_size={t.micro_batch_size} does not divide the mini-batch "
                            f"of {t.mini_batch_size or batch} sequences")
        if run.prompts_per_step % world_size:
            problems.append(f"run.prompts_per_step={run.prompts_per_step} must divide evenly over {world_size} ranks")
        for key, text in (("train.mesh", t.mesh), ("rollout.mesh", r.mesh)):
            if text:
                try:
                    MeshSpec.parse(text).validate(world_size)
                except MeshError as err:
                    problems.append(f"{key}: {err}")
        if run.steps < 1:
            problems.append(f"run.steps={run.steps} must be >= 1")
        if run.resume not in ("auto", "never") and not os.path.isdir(run.resume):
            problems.append(f"run.resume={run.resume!r}: use 'auto', 'never' or an existing checkpoint folder")
        if problems:
            raise ConfigError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
        return self


def _coerce(value: Any, kind: Any, key: str) -> Any:
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None))
        origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return _build(kind, value, key)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):  # YAML reads '1e-3' (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if kind in (int, str, bool) and type(value) is kind:
        return value
    if origin is list and isinstance(value, list):
        return value
    if origin is dict and isinstance(value, dict):
        return value
    if kind is str and isinstance(value, (int, float)):
        return str(value)
    raise ConfigError(f"{key}={value!r}: expected {getattr(kind, '__name__', kind)}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = prefix or "the top level"
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known: {sorted(names)}")
    return cls(**{k: _coerce(v, hints[k], f"{prefix}.{k}".lstrip(".")) for k, v in data.items()})


def parse_overrides(overrides: list[str]) -> dict:
    """['a.b=1', 'c=x'] -> {'a': {'b': 1}, 'c': 'x'}; values are read as YAML scalars."""
    import yaml

    out: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return out


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k != "options":
            _merge(base[k], v)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return base


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the overrides."""
    import yaml

    data = Config().to_dict()
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        _merge(data, loaded)
    _merge(data, parse_overrides(overrides or []))
    return _build(Config, data)
