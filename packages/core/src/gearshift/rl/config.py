"""Run configuration: typed dataclasses are the one source of truth, filled through OmegaConf.

A YAML file fills them, then dotted overrides from the command line
(`rollout.backend=vllm train.lr=1e-5`); values may interpolate others
(`run.output_dir: runs/${algorithm.name}`). OmegaConf checks names and types as
it merges; `validate()` then checks what spans fields, up front, and says what
to change. Every error names the file (with line and column), the override or
the key it comes from.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .agent.config import AgentConfig


class ConfigError(ValueError):
    """A configuration that cannot run, with what to change."""


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank (through peft); 0: no LoRA, every weight trains
    alpha: int = 16  # the adapters are scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input while training
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # names/suffixes, or all-linear
    # what a switch sends the rollout engine: merged (W + alpha/r B A, any engine) or adapter (the adapter alone,
    # served on the base by an engine that can: vllm)
    sync: str = "merged"

    @property
    def adapter_sync(self) -> bool:
        return bool(self.r) and self.sync == "adapter"

    def train_options(self) -> dict[str, Any]:
        """The options a trainer built on `ModuleTrainEngine` takes for this (none when r is 0)."""
        if not self.r:
            return {}
        return {"lora_r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "lora_target_modules": list(self.target_modules)}


@dataclass
class ModelConfig:
    path: str = "small-add"  # a folder, or a preset built locally ('tiny', 'small', 'small-add', ...)
    dtype: str = "float32"
    dropout: bool = False  # train with the model's dropout; off by default: an on-policy update with it is off-policy
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters only; the rollout gets merged weights


@dataclass
class DataConfig:
    path: str | None = None  # jsonl or parquet with a 'prompt' column; None: the built-in task
    task: str = "add"  # built-in task when path is None
    task_options: dict[str, Any] = field(default_factory=lambda: {"digits": 1, "second": 1})
    prompt_key: str = "prompt"
    max_prompt_len: int = 64
    seed: int = 0
    # a held-out jsonl/parquet set (same columns) the policy is evaluated on every run.eval_every steps and at
    # the end; None: no evaluation
    val_path: str | None = None


@dataclass
class RolloutConfig:
    backend: str = "vllm"
    n: int = 8  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 4
    stop: list[str] = field(default_factory=list)
    max_model_len: int | None = None  # context of the rollout engine; None: the model's own
    dtype: str = ""  # dtype of the rollout engine's weights ('bfloat16', ...); empty: model.dtype, like training
    mesh: str = ""  # e.g. 'dp=2'; empty: dp = world size
    options: dict[str, Any] = field(default_factory=dict)  # the engine's own options ('gearshift backends NAME')


@dataclass
class TrainConfig:
    backend: str = "fsdp"
    lr: float = 0.0  # the policy's learning rate; 0: the algorithm's own (Config.policy_lr: grpo 3e-4, ppo 2e-4)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # sequences per optimizer step, over the whole batch; 0: the algorithm's own: grpo takes the whole batch
    # in one step, ppo takes it in two (its critic-based advantages gain from a second, slightly off-policy step)
    mini_batch_size: int = 0
    micro_batch_size: int = 0  # sequences per forward/backward; 0: the whole mini-batch
    max_tokens_per_micro_batch: int = 0  # pack sequences by length into micro-batches of this many tokens; 0: off
    mesh: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # the engine's own options ('gearshift backends NAME')


@dataclass
class SwitchConfig:
    resharder: str = "stream"  # a reshard backend ('gearshift backends --kind reshard')
    share: str = "auto"  # auto | on | off: serve rollout from the trainer's tensors when the pair can
    bucket_mb: int = 128  # weights travel in buckets of about this many MiB
    # train state moved to host memory during rollout: auto (on a GPU, only what the rollout engine's memory
    # needs, largest first; see gearshift.memory), none, or tags to always move, e.g. optimizer,grads
    offload: str = "auto"
    offload_params: bool = False  # also move the trained weights to host during rollout (turns sharing off)
    options: dict[str, Any] = field(default_factory=dict)  # more resharder options

    def __post_init__(self) -> None:
        # YAML reads a bare on / off as a boolean, which lands in this str field as 'True' / 'False'
        self.share = {"True": "on", "true": "on", "False": "off", "false": "off"}.get(str(self.share), self.share)


#: algorithm.gae_norm -> the options of the gae estimator
GAE_NORMS = {"center_scale": {"whiten_advantages": True, "center": True},
             "scale": {"whiten_advantages": True, "center": False},
             "none": {"whiten_advantages": False}}


#: (engine kind, common argument) -> the key of the run's config that sets it ("": either kind)
COMMON_KEYS = {("", "model"): "model.path", ("", "seed"): "run.seed", ("rollout", "dtype"): "rollout.dtype",
               ("train", "dtype"): "model.dtype", ("rollout", "mesh"): "rollout.mesh", ("train", "mesh"): "train.mesh",
               ("", "max_model_len"): "rollout.max_model_len", ("", "lr"): "train.lr",
               ("", "weight_decay"): "train.weight_decay", ("", "max_grad_norm"): "train.max_grad_norm",
               ("", "micro_batch_size"): "train.micro_batch_size",
               ("", "max_tokens_per_micro_batch"): "train.max_tokens_per_micro_batch",
               ("", "dropout"): "model.dropout", ("", "value_head"): "algorithm.name=ppo (its critic)",
               ("rollout", "max_lora_rank"): "model.lora.sync=adapter (with model.lora.r)"}


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
    # GAE (ppo): with outcome rewards, gamma = lam = 1 makes each token's advantage the reward minus the
    # critic's value of the state it was chosen in; the critic learns at 5x the policy's default lr
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-3
    critic_warmup: int = 0  # ppo: steps that train the critic alone before the policy learns
    critic_epochs: int = 0  # ppo: passes of the critic over each batch; 0: algorithm.epochs
    # ppo: advantages over the batch: scale (divide by their std: the critic is the baseline already) |
    # center_scale (whiten: also subtract their mean) | none
    gae_norm: str = "scale"
    value_clip: float = 0.2
    rollout_correction: str = "none"  # none | tis | mis: correct for rollout/trainer probability gaps
    rollout_correction_level: str = "token"  # token | sequence (product of ratios) | geometric (their mean)
    rollout_correction_cap: float = 2.0  # C: tis weights min(ratio, C); mis keeps ratios in [1/C, C]
    # run.placement=split: rollout of step k+1 runs while step k trains, on samples up to this many updates old
    off_policy_steps: int = 0
    # the trainer's logprobs of the sampled tokens before the update: auto takes them from the training forward
    # itself (detached) when the batch trains once, in one mini-batch, with no rollout correction and no KL in
    # the reward (the ratio is then exactly 1); recompute always runs the separate forward pass
    old_logprobs: str = "auto"


@dataclass
class RewardConfig:
    fn: str | None = None  # 'module:fn' or 'path/to/file.py:fn'; None: the built-in task's own reward (no model)
    model: str | None = None  # a reward model: a folder or preset ('small-add-rm') of a one-output classifier
    weights: list[float] = field(default_factory=lambda: [1.0, 1.0])  # [fn, model] when a model scores
    model_batch_size: int = 32  # completions per reward-model forward

    def resolved(self, data: "DataConfig") -> str:
        """The reward to load: `fn`, or the one that grades the built-in task (`validate` checks there is one)."""
        from .tasks import TASK_REWARDS

        return self.fn or TASK_REWARDS[data.task]

    def rule(self, data: "DataConfig") -> str | None:
        """The rule reward that takes part: `fn`; with no `fn`, the built-in task's own unless a model scores."""
        return self.fn if self.fn or self.model else self.resolved(data)


@dataclass
class PoolsConfig:
    """run.placement=split: the workers of each pool, and where the other models run."""

    train: int = 1  # workers (one device each) that train the policy (and the critic)
    rollout: int = 1  # workers (one device each) that run the rollout engine
    reference: str = "train"  # train | rollout: the pool whose workers hold the KL reference
    reward_model: str = "rollout"  # rollout | train: the pool whose workers hold reward.model
    device: str = "auto"  # auto (a GPU per worker when the cluster has GPUs) | cpu | gpu
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker


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
    eval_every: int = 0  # evaluate on data.val_path every this many steps (and after the last); 0: after the last
    eval_greedy: bool = True  # evaluation decodes greedily (one completion a prompt); false: the rollout sampling
    plot: bool = True
    progress: bool = True
    # colocated: every role on every rank, one process per device (torchrun); split: training and rollout on
    # separate pools of workers started by Ray, driven by this process (run.pools sizes them)
    placement: str = "colocated"
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    ray_address: str = ""  # split: the Ray cluster to join ('auto', 'host:6379'); empty: start one here


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    switch: SwitchConfig = field(default_factory=SwitchConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn episodes: tools, environments, limits

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.structured(self))

    def validate(self, world_size: int = 1, *, reward_given: bool = False, eval_given: bool = False) -> "Config":
        """Raise `ConfigError` listing every problem and what to change (`reward_given`: a reward function
        comes with the run, so `reward.fn` may stay unset; `eval_given`: so does a held-out set, so
        `data.val_path` may)."""
        from ..mesh import MeshError, MeshSpec
        from ..options import DTYPES
        from ..rollout import RolloutError, SamplingParams
        from ..tags import TRAIN_TAGS
        from .algos import CORRECTION_LEVELS, CORRECTIONS
        from .tasks import TASKS

        problems: list[str] = []
        a, r, t, run, sw = self.algorithm, self.rollout, self.train, self.run, self.switch
        try:
            self.sampling()
        except RolloutError as err:
            problems.append(f"rollout: {err}")
        if r.max_model_len is not None and r.max_model_len < 1:
            problems.append(f"rollout.max_model_len={r.max_model_len} must be >= 1 (or null: the model's own)")
        elif r.max_model_len is not None and self.data.max_prompt_len + r.max_tokens > r.max_model_len:
            problems.append(self.context_problem(r.max_model_len))
        if self.data.max_prompt_len < 1:
            problems.append(f"data.max_prompt_len={self.data.max_prompt_len} must be >= 1")
        if not self.data.path and self.data.task not in TASKS:
            problems.append(f"data.task={self.data.task!r}: built-in tasks are {', '.join(TASKS)} "
                            f"(or set data.path to a jsonl/parquet file)")
        if self.agent.enabled(None if self.data.path else self.data.task):
            problems += self.agent.problems(max_prompt_len=self.data.max_prompt_len, max_model_len=r.max_model_len,
                                            turn_tokens=r.max_tokens)
        if (self.data.path and not self.reward.fn and not self.reward.model and not reward_given
                and not self.agent.environment):
            problems.append("reward.fn is not set: a dataset (data.path) needs a reward, e.g. "
                            "reward.fn=my_rewards.py:score")
        if sw.share not in ("auto", "on", "off"):
            problems.append(f"switch.share={sw.share!r}: use auto, on or off")
        if sw.bucket_mb < 1:
            problems.append(f"switch.bucket_mb={sw.bucket_mb} must be >= 1")
        unknown_tags = [tag for tag in self.offload_tags() if tag not in TRAIN_TAGS]
        if sw.offload != "auto" and unknown_tags:
            problems.append(f"switch.offload={sw.offload!r}: unknown tags {unknown_tags}; use auto, none, or tags "
                            f"from {list(TRAIN_TAGS)} (e.g. optimizer,grads)")
        if sw.share == "on" and sw.offload_params:
            problems.append("switch.share=on with switch.offload_params=true: the rollout engine would read "
                            "weights that were moved away; drop one")
        if a.name not in ("grpo", "ppo"):
            problems.append(f"algorithm.name={a.name!r}: use 'grpo' or 'ppo'")
        if a.name == "grpo" and r.n < 2:
            problems.append(f"rollout.n={r.n}: GRPO compares samples of one prompt, so use n >= 2")
        if a.old_logprobs not in ("auto", "recompute"):
            problems.append(f"algorithm.old_logprobs={a.old_logprobs!r}: use auto or recompute")
        if a.rollout_correction not in CORRECTIONS:
            problems.append(f"algorithm.rollout_correction={a.rollout_correction!r}: use one of "
                            f"{', '.join(CORRECTIONS)}")
        if a.rollout_correction_level not in CORRECTION_LEVELS:
            problems.append(f"algorithm.rollout_correction_level={a.rollout_correction_level!r}: use one of "
                            f"{', '.join(CORRECTION_LEVELS)}")
        if not a.rollout_correction_cap >= 1:
            problems.append(f"algorithm.rollout_correction_cap={a.rollout_correction_cap} must be >= 1 "
                            f"(tis: weights at most C; mis: ratios kept in [1/C, C])")
        if r.dtype and r.dtype not in DTYPES:
            problems.append(f"rollout.dtype={r.dtype!r}: use one of {', '.join(sorted(DTYPES))} "
                            f"(or leave it empty: model.dtype)")
        if a.gae_norm not in GAE_NORMS:
            problems.append(f"algorithm.gae_norm={a.gae_norm!r}: use one of {', '.join(GAE_NORMS)}")
        if a.critic_warmup < 0:
            problems.append(f"algorithm.critic_warmup={a.critic_warmup} must be >= 0")
        if a.critic_epochs < 0:
            problems.append(f"algorithm.critic_epochs={a.critic_epochs} must be >= 0 (0: algorithm.epochs)")
        if t.lr < 0:
            problems.append(f"train.lr={t.lr} must be > 0 (or 0: the algorithm's own)")
        if t.max_tokens_per_micro_batch < 0:
            problems.append(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} must be >= 0")
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
        if run.placement != "split" and run.prompts_per_step % world_size:
            problems.append(f"run.prompts_per_step={run.prompts_per_step} must divide evenly over {world_size} ranks")
        for key, text, role in (("train.mesh", t.mesh, "train"), ("rollout.mesh", r.mesh, "rollout")):
            if text:
                try:
                    MeshSpec.parse(text).validate(self.ranks_of(role, world_size))
                except MeshError as err:
                    problems.append(f"{key}: {err}")
        if run.steps < 1:
            problems.append(f"run.steps={run.steps} must be >= 1")
        if run.eval_every < 0:
            problems.append(f"run.eval_every={run.eval_every} must be >= 0 (0: evaluate after the last step only)")
        if run.eval_every and not self.data.val_path and not eval_given:
            problems.append(f"run.eval_every={run.eval_every} needs a held-out set: set data.val_path to a "
                            f"jsonl/parquet file (or pass eval_dataset= to Trainer)")
        problems += self._lora_and_reward_model_problems()
        problems += self._options_problems()
        problems += self._placement_problems()
        if run.resume not in ("auto", "never") and not os.path.isdir(run.resume):
            problems.append(f"run.resume={run.resume!r}: use 'auto', 'never' or an existing checkpoint folder")
        if problems:
            raise ConfigError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
        return self

    def _options_problems(self) -> list[str]:
        """An engine's own options may not restate what every engine of its kind is built from."""
        from ..rollout import RolloutArgs
        from ..train import TrainArgs

        problems = []
        for kind, args, own in (("rollout", RolloutArgs, self.rollout.options),
                                ("train", TrainArgs, self.train.options)):
            common = {f.name for f in dataclasses.fields(args)}
            for key in sorted(common & set(own)):
                where = COMMON_KEYS.get((kind, key), COMMON_KEYS.get(("", key), ""))
                problems.append(f"{kind}.options.{key}: {key} is an argument of every {kind} engine, "
                                f"set by {where or 'the run'}; remove it from {kind}.options")
        return problems

    def policy_lr(self) -> float:
        """The policy's learning rate: `train.lr`, or the algorithm's own (PPO's two optimizer steps a batch
        take a smaller one)."""
        return self.train.lr or (2e-4 if self.algorithm.name == "ppo" else 3e-4)

    def resharder(self) -> str:
        """The reshard backend a switch uses: `adapter` with `model.lora.sync=adapter`, else `switch.resharder`."""
        return "adapter" if self.model.lora.adapter_sync else self.switch.resharder

    def mini_batches(self) -> int:
        """Optimizer steps each epoch takes over a step's batch: `train.mini_batch_size` or the algorithm's own."""
        batch = self.run.prompts_per_step * self.rollout.n
        if self.train.mini_batch_size:
            return max(1, batch // self.train.mini_batch_size)
        return 2 if self.algorithm.name == "ppo" and batch >= 2 else 1

    def offload_tags(self) -> str | list[str]:
        """`switch.offload` as `HybridActor` takes it: "auto", or the tags to move."""
        text = self.switch.offload.strip()
        if text in ("auto", ""):
            return "auto"
        return [] if text == "none" else [t.strip() for t in text.split(",") if t.strip()]

    def ranks_of(self, role: str, world_size: int) -> int:
        """The ranks `role` ('train' or 'rollout') runs on: its pool's size when split, else the world."""
        return getattr(self.run.pools, role) if self.run.placement == "split" else world_size

    def _placement_problems(self) -> list[str]:
        run, pools, a = self.run, self.run.pools, self.algorithm
        problems = []
        if run.placement not in ("colocated", "split"):
            return [f"run.placement={run.placement!r}: use colocated or split"]
        if a.off_policy_steps < 0:
            problems.append(f"algorithm.off_policy_steps={a.off_policy_steps} must be >= 0 (0: on-policy)")
        if run.placement == "split" and (self.data.val_path or run.eval_every):
            problems.append("data.val_path / run.eval_every: held-out evaluation runs with run.placement=colocated; "
                            "drop them for a split run")
        if run.placement == "colocated":
            if a.off_policy_steps:
                problems.append(f"algorithm.off_policy_steps={a.off_policy_steps} needs run.placement=split: "
                                f"colocated, rollout and training take turns on the same devices")
            return problems
        for role in ("train", "rollout"):
            size = getattr(pools, role)
            if size < 1:
                problems.append(f"run.pools.{role}={size} must be >= 1")
            elif run.prompts_per_step % size:
                problems.append(f"run.prompts_per_step={run.prompts_per_step} must divide evenly over the "
                                f"{size} workers of run.pools.{role}")
        for key, value, where in (("reference", pools.reference, ("train", "rollout")),
                                  ("reward_model", pools.reward_model, ("train", "rollout")),
                                  ("device", pools.device, ("auto", "cpu", "gpu"))):
            if value not in where:
                problems.append(f"run.pools.{key}={value!r}: use one of {', '.join(where)}")
        if pools.cpus_per_worker <= 0:
            problems.append(f"run.pools.cpus_per_worker={pools.cpus_per_worker} must be > 0")
        return problems

    def _lora_and_reward_model_problems(self) -> list[str]:
        lora, rw = self.model.lora, self.reward
        problems = []
        if lora.r < 0:
            problems.append(f"model.lora.r={lora.r} must be >= 0 (0: no LoRA)")
        if lora.r and lora.alpha <= 0:
            problems.append(f"model.lora.alpha={lora.alpha} must be > 0")
        if not 0 <= lora.dropout < 1:
            problems.append(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
        if lora.r and not lora.target_modules:
            problems.append("model.lora.target_modules is empty: name layers (e.g. [q_proj, v_proj]) or use "
                            "[all-linear]")
        if lora.sync not in ("merged", "adapter"):
            problems.append(f"model.lora.sync={lora.sync!r}: use merged or adapter")
        elif lora.sync == "adapter":
            if not lora.r:
                problems.append("model.lora.sync=adapter needs LoRA: set model.lora.r (e.g. 8)")
            if self.run.placement != "colocated":
                problems.append("model.lora.sync=adapter runs colocated only: set run.placement=colocated, or "
                                "model.lora.sync=merged")
            if self.switch.resharder not in ("stream", "adapter"):
                problems.append(f"model.lora.sync=adapter syncs through the adapter resharder, not "
                                f"switch.resharder={self.switch.resharder!r}: drop one")
            if self.switch.share == "on":
                problems.append("model.lora.sync=adapter with switch.share=on: the rollout engine holds its own "
                                "base weights, it cannot serve from the trainer's; drop one")
        if len(rw.weights) != 2:
            problems.append(f"reward.weights={rw.weights}: give two weights, for [fn, model]")
        if rw.model_batch_size < 1:
            problems.append(f"reward.model_batch_size={rw.model_batch_size} must be >= 1")
        return problems

    def sampling(self, seed: int | None = None):
        """The rollout section as `SamplingParams` (raises `RolloutError` on bad values)."""
        from ..rollout import SamplingParams

        r = self.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=r.max_tokens, stop=tuple(r.stop), seed=seed)

    def context_problem(self, context: int) -> str:
        return (f"data.max_prompt_len={self.data.max_prompt_len} + rollout.max_tokens={self.rollout.max_tokens} "
                f"is more than the context of {context} tokens: a long prompt would leave its completion cut "
                f"short; lower one of them (or raise rollout.max_model_len, if the model allows)")


def _config_error(err: Exception, where: str) -> ConfigError:
    """An OmegaConf error as a `ConfigError` naming the key and where the value came from."""
    from omegaconf.errors import ConfigKeyError

    key = getattr(err, "full_key", None) or ""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    if isinstance(err, ConfigKeyError) and key:
        section, _, name = key.rpartition(".")
        node = _section(section)
        known = sorted(f.name for f in dataclasses.fields(node)) if node else []
        return ConfigError(f"{where}: unknown key {name!r} in {section or 'the top level'}; known: {known}")
    return ConfigError(f"{where}: {key + ': ' if key else ''}{message}")


def _section(dotted: str):
    """The dataclass of section `dotted` ('' is `Config`), or None."""
    import typing

    node = Config
    for part in filter(None, dotted.split(".")):
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return None
    return node


def _merge(base, extra, where: str):
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, extra)
    except OmegaConfBaseException as err:
        raise _config_error(err, where) from None


def _read_yaml(path: str | os.PathLike):
    import yaml
    from omegaconf import DictConfig, OmegaConf

    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{at}: not valid YAML: {problem}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, rollout, ...)")
    return loaded


def _parse_override(item: str):
    import yaml
    from omegaconf import OmegaConf

    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {problem}") from None


def _finish(cfg, where: str) -> "Config":
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _config_error(err, where) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the overrides (each `section.key=value`, the value read as YAML)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(Config)
    if path is not None:
        cfg = _merge(cfg, _read_yaml(path), str(path))
    for item in overrides or []:
        cfg = _merge(cfg, _parse_override(item), f"override {item!r}")
    return _finish(cfg, str(path) if path else "the configuration")


def build_config(base: Config | None = None, sections: dict[str, Any] | None = None) -> Config:
    """`base` (default: the defaults) with `sections` merged over it, e.g. {"run": {"steps": 10}}."""
    from omegaconf import OmegaConf

    cfg = _merge(OmegaConf.structured(base or Config()), sections or {}, "the sections given")
    return _finish(cfg, "the sections given")
