"""The engines a run config names, built the same way wherever they run.

The colocated controller builds them all in one process group; with training
and rollout on separate pools (`run.placement=split`), each pool's workers
build theirs from the same functions, so both placements get the same
options.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from .. import registry
from .config import Config, ConfigError


def train_options(cfg: Config, model_path: str) -> dict[str, Any]:
    """What the policy is built from (the reference and the critic start from it too)."""
    t = cfg.train
    return {"model": model_path, "dtype": cfg.model.dtype, "seed": cfg.run.seed, "mesh": t.mesh,
            "lr": cfg.policy_lr(), "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
            "micro_batch_size": t.micro_batch_size, "max_tokens_per_micro_batch": t.max_tokens_per_micro_batch,
            "dropout": cfg.model.dropout, "share_prompts": t.share_prompts, **cfg.model.lora.train_options(),
            **t.options}


def build_policy(cfg: Config, model_path: str):
    return registry.create("train", cfg.train.backend, **train_options(cfg, model_path))


def build_reference(cfg: Config, model_path: str, **override: Any):
    """A frozen copy of the starting policy (it never steps, so it holds no optimizer state); None without KL.
    `override`: options that differ from the policy's (another pool's `mesh`)."""
    if cfg.algorithm.kl_coef <= 0:
        return None
    return registry.create("train", cfg.train.backend, **{**train_options(cfg, model_path), **override})


def check_options(cfg: Config) -> None:
    """The train, rollout and reshard backends are installed; every key of `train.options` and `rollout.options`
    names an option of its backend, with a value of its type, and every key of `switch.options` one its
    resharder takes. A typo fails before anything is built, not when that engine's turn comes (the rollout
    engine is built after the trainer has loaded the model)."""
    from ..options import OptionError, check_options as check_engine_options

    for kind in ("train", "rollout"):
        section = getattr(cfg, kind)
        try:
            check_engine_options(registry.load(kind, section.backend), dict(section.options))
        except OptionError as err:
            raise ConfigError(f"{kind}.options: {kind} backend {section.backend!r}: {err}") from None
    name = cfg.resharder()
    try:  # a resharder takes its options as keywords of its constructor
        inspect.signature(registry.load("reshard", name)).bind_partial(**cfg.switch.options)
    except TypeError as err:
        raise ConfigError(f"switch.options: reshard backend {name!r}: {err}") from None


#: the files of which a Hugging Face folder's tokenizer loads (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def check_context(cfg: Config, model_path: str) -> None:
    """The model's folder holds a tokenizer, and prompt and completion fit its context, before anything is built.

    Without a tokenizer's files transformers still makes one, which turns every prompt into no tokens."""
    from transformers import AutoConfig

    if os.path.isdir(model_path) and not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path={model_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                          f"copy the model's tokenizer files into the folder (tokenizer.save_pretrained(folder))")
    model_config = AutoConfig.from_pretrained(model_path)
    context = cfg.rollout.max_model_len or getattr(model_config, "max_position_embeddings", None) or \
        getattr(model_config, "n_positions", None)
    if context and cfg.data.max_prompt_len + cfg.rollout.max_tokens > context:
        raise ConfigError(cfg.context_problem(context))


def build_critic(cfg: Config, model_path: str):
    """The value model of PPO: the policy's model with a value head, at the critic's learning rate; else None."""
    if cfg.algorithm.name != "ppo":
        return None
    return registry.create("train", cfg.train.backend,
                           **{**train_options(cfg, model_path), "lr": cfg.algorithm.critic_lr, "share_prompts": None},
                           value_head=True)


def build_rollout(cfg: Config, model_path: str):
    """The rollout engine, checked to hold a prompt and its completion."""
    r = cfg.rollout
    lora = cfg.model.lora
    rollout = registry.create("rollout", r.backend, model=model_path, dtype=cfg.rollout_dtype(),
                              seed=cfg.run.seed, mesh=r.mesh, max_model_len=r.max_model_len,
                              **({"max_lora_rank": lora.r} if lora.adapter_sync else {}),
                              **{"max_batch_tokens": cfg.rollout_batch_tokens(), **r.options})
    if rollout.max_model_len < cfg.data.max_prompt_len + r.max_tokens:
        raise ConfigError(cfg.context_problem(rollout.max_model_len) + f" (the {r.backend} engine's context)")
    return rollout


def build_resharder(cfg: Config):
    sw = cfg.switch
    name = cfg.resharder()
    return registry.create("reshard", name, bucket_bytes=sw.bucket_mb << 20, **sw.options,
                           **({"share": sw.share_flag} if name == "stream" else {}))


def build_reward_model(cfg: Config, path: str, device, dtype):
    """The learned reward of `reward.model` (already resolved to `path`) on `device`."""
    from .reward_model import RewardModel

    return RewardModel(path, device=device, dtype=dtype, batch_size=cfg.reward.model_batch_size)
