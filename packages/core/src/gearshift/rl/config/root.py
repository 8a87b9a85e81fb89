"""The whole run config: its sections, and the rules that span more than one of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .agent import AgentConfig
from .algorithm import AlgorithmConfig
from .base import ConfigError, Section, commented_yaml
from .run import RunConfig
from .sections import DataConfig, ModelConfig, RewardConfig, RolloutConfig, SwitchConfig, TrainConfig


#: the policy when model.path is unset: the default job's, or the built-in task's own where the default job's
#: cannot write the task's format (calc's episodes call a tool)
DEFAULT_MODEL = "small-add"
TASK_DEFAULT_MODELS = {"calc": "small-calc"}
#: with rollout.logprobs=auto and no rollout correction, the steps whose rollout brings logprobs (for the
#: mismatch/* figures): the first, then every this many
MISMATCH_EVERY = 10


@dataclass
class Config(Section):
    """A run of gearshift: `gearshift train` fills one from defaults, a YAML file and overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy's model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine and its sampling."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The train engine and its batches."""
    switch: SwitchConfig = field(default_factory=SwitchConfig)
    """The switch between training and rollout."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, output, logging and placement."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes: tools, environments and their limits."""

    def __post_init__(self) -> None:
        if self.model.path is None:  # filled here, once every source is merged (the loaders build the object last)
            self.model.path = DEFAULT_MODEL if self.data.path else TASK_DEFAULT_MODELS.get(self.data.task, DEFAULT_MODEL)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self, comments: bool = False) -> str:
        """The config as YAML; `comments`: each key under its help (what `--print-config` shows)."""
        from omegaconf import OmegaConf

        return commented_yaml(self) + "\n" if comments else OmegaConf.to_yaml(OmegaConf.structured(self))

    def validate(self, world_size: int = 1, *, reward_given: bool = False, eval_given: bool = False) -> Config:
        """Raise `ConfigError` listing every problem and what to change: each section's own, then the rules
        across sections (`reward_given`: a reward function comes with the run, so `reward.fn` may stay unset;
        `eval_given`: so does a held-out set, so `data.val_path` may)."""
        problems = [*self.all_problems(), *self._context_problems(), *self._reward_problems(reward_given),
                    *self._agent_problems(), *self._logprob_problems(),
                    *self._batch_problems(world_size), *self._mesh_problems(world_size),
                    *self._eval_problems(eval_given), *self._placement_problems(), *self._adapter_sync_problems(),
                    *self._options_problems()]
        if problems:
            raise ConfigError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
        return self

    def _context_problems(self) -> list[str]:
        context = self.rollout.max_model_len
        if context is not None and context >= 1 and self.data.max_prompt_len + self.rollout.max_tokens > context:
            return [self.context_problem(context)]
        return []

    def _agent_problems(self) -> list[str]:
        if not self.episodes():
            return []
        return self.agent.limit_problems(max_prompt_len=self.data.max_prompt_len,
                                         max_model_len=self.rollout.max_model_len, turn_tokens=self.rollout.max_tokens)

    def _logprob_problems(self) -> list[str]:
        a = self.algorithm
        if self.rollout.logprobs == "never" and a.rollout_correction != "none":
            return [f"algorithm.rollout_correction={a.rollout_correction} weighs each token by the rollout engine's "
                    f"logprobs, which rollout.logprobs=never leaves out: set rollout.logprobs=auto"]
        return []

    def _reward_problems(self, reward_given: bool) -> list[str]:
        problems = []
        if (self.data.path and not self.reward.fn and not self.reward.model and not reward_given
                and not self.agent.environment):  # an environment owns its reward
            problems.append("reward.fn is not set: a dataset (data.path) needs a reward, e.g. "
                            "reward.fn=my_rewards.py:score")
        return problems

    def _batch_problems(self, world_size: int) -> list[str]:
        r, t, run = self.rollout, self.train, self.run
        problems = []
        if self.algorithm.name == "grpo" and r.n < 2:
            problems.append(f"rollout.n={r.n}: GRPO compares samples of one prompt, so use n >= 2")
        batch = run.prompts_per_step * r.n
        mini = t.mini_batch_size
        if mini and batch % mini:
            problems.append(f"train.mini_batch_size={mini} does not divide the batch of "
                            f"run.prompts_per_step x rollout.n = {batch} sequences")
        if mini and mini % r.n:
            problems.append(f"train.mini_batch_size={mini} must be a multiple of rollout.n={r.n} "
                            f"so that each GRPO group stays in one mini-batch")
        if t.micro_batch_size and (mini or batch) % t.micro_batch_size:
            problems.append(f"train.micro_batch_size={t.micro_batch_size} does not divide the mini-batch "
                            f"of {mini or batch} sequences")
        if run.placement != "split" and run.prompts_per_step % world_size:
            problems.append(f"run.prompts_per_step={run.prompts_per_step} must divide evenly over {world_size} ranks")
        return problems

    def _mesh_problems(self, world_size: int) -> list[str]:
        from ...mesh import MeshError, MeshSpec

        problems = []
        for role in ("train", "rollout"):
            text = getattr(self, role).mesh
            if text:
                try:
                    MeshSpec.parse(text).validate(self.ranks_of(role, world_size))
                except MeshError as err:
                    problems.append(f"{role}.mesh: {err}")
        return problems

    def _eval_problems(self, eval_given: bool) -> list[str]:
        run = self.run
        problems = []
        if run.eval_every and not self.data.val_path and not eval_given:
            problems.append(f"run.eval_every={run.eval_every} needs a held-out set: set data.val_path to a "
                            f"jsonl/parquet file (or pass eval_dataset= to Trainer)")
        if run.placement == "split" and (self.data.val_path or run.eval_every):
            problems.append("data.val_path / run.eval_every: held-out evaluation runs with run.placement=colocated; "
                            "drop them for a split run")
        return problems

    def _placement_problems(self) -> list[str]:
        run, steps = self.run, self.algorithm.off_policy_steps
        if run.placement == "colocated":
            return [] if not steps else [f"algorithm.off_policy_steps={steps} needs run.placement=split: "
                                         f"colocated, rollout and training take turns on the same devices"]
        return [f"run.prompts_per_step={run.prompts_per_step} must divide evenly over the {size} workers of "
                f"run.pools.{role}" for role in ("train", "rollout")
                if (size := getattr(run.pools, role)) >= 1 and run.prompts_per_step % size]

    def _adapter_sync_problems(self) -> list[str]:
        if self.model.lora.sync != "adapter":
            return []
        problems = []
        if self.run.placement != "colocated":
            problems.append("model.lora.sync=adapter runs colocated only: set run.placement=colocated, or "
                            "model.lora.sync=merged")
        if self.switch.resharder not in ("stream", "adapter"):
            problems.append(f"model.lora.sync=adapter syncs through the adapter resharder, not "
                            f"switch.resharder={self.switch.resharder!r}: drop one")
        if self.switch.share == "on":
            problems.append("model.lora.sync=adapter with switch.share=on: the rollout engine holds its own "
                            "base weights, it cannot serve from the trainer's; drop one")
        return problems

    def _options_problems(self) -> list[str]:
        """An engine's own options may not restate what every engine of its kind is built from."""
        from ...rollout import RolloutArgs
        from ...train import TrainArgs

        problems = []
        for kind, args in (("rollout", RolloutArgs), ("train", TrainArgs)):
            own = getattr(self, kind).options
            for key in sorted({f.name for f in dataclasses.fields(args)} & set(own)):
                problems.append(f"{kind}.options.{key}: {key} is an argument of every {kind} engine, "
                                f"set by {self.key_setting(kind, key)}; remove it from {kind}.options")
        return problems

    def key_setting(self, kind: str, argument: str) -> str:
        """The key of this config that sets `argument` of every `kind` ('train', 'rollout') engine: the key of
        that name in the engine's own section, else in model or run."""
        if argument == "model":
            return "model.path"
        for section in (kind, "model", "run"):
            if argument in {f.name for f in dataclasses.fields(getattr(self, section))}:
                return f"{section}.{argument}"
        return "the run"

    def policy_lr(self) -> float:
        """The policy's learning rate: `train.lr`, or the algorithm's own (PPO's two optimizer steps a batch
        take a smaller one)."""
        return self.train.lr or (2e-4 if self.algorithm.name == "ppo" else 3e-4)

    def rollout_dtype(self) -> str:
        """The rollout engine's dtype: `rollout.dtype`, or training's (`model.dtype`)."""
        return self.rollout.dtype or self.model.dtype

    def reward_rule(self) -> str | None:
        """The reward function the run scores with (`reward.rule`), or None where the environment of a
        dataset's episodes gives the reward and no `reward.fn` is set."""
        if self.data.path and self.agent.environment and not self.reward.fn:
            return None
        return self.reward.rule(self.data)

    def builtin_task(self) -> str | None:
        """The built-in task the rows come from (`data.task`), or None when `data.path` names a dataset."""
        return None if self.data.path else self.data.task

    def episodes(self) -> bool:
        """Whether samples are episodes: the agent section names a tool or an environment, or the built-in
        task has one."""
        return self.agent.enabled(self.builtin_task())

    def rollout_batch_tokens(self) -> int:
        """Tokens a step's rollout holds at once: every sample's prompt and answer, or its whole episode when
        episodes run (the rollout engine's `max_batch_tokens`)."""
        answer = max(self.rollout.max_tokens, self.agent.max_tokens) if self.episodes() else self.rollout.max_tokens
        return self.run.prompts_per_step * self.rollout.n * (self.data.max_prompt_len + answer)

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
        return self.switch.offload_tags()

    def ranks_of(self, role: str, world_size: int) -> int:
        """The ranks `role` ('train' or 'rollout') runs on: its pool's size when split, else the world."""
        return getattr(self.run.pools, role) if self.run.placement == "split" else world_size

    def sampling(self, seed: int | None = None, step: int | None = None):
        """The rollout section as `SamplingParams` for the rollout of step `step` (counted from 0; None: any step
        but one of `rollout_logprobs`'s measured ones). Raises `RolloutError` on bad values."""
        from ...rollout import SamplingParams

        r = self.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=r.max_tokens, stop=tuple(r.stop), seed=seed,
                              logprobs=self.rollout_logprobs(step))

    def rollout_logprobs(self, step: int | None) -> bool:
        """Whether step `step`'s rollout asks the engine for each sampled token's logprob (`rollout.logprobs`)."""
        setting = self.rollout.logprobs
        if setting != "auto":
            return setting == "always"
        if self.algorithm.rollout_correction != "none":
            return True
        return step is not None and step % MISMATCH_EVERY == 0

    def context_problem(self, context: int) -> str:
        return (f"data.max_prompt_len={self.data.max_prompt_len} + rollout.max_tokens={self.rollout.max_tokens} "
                f"is more than the context of {context} tokens: a long prompt would leave its completion cut "
                f"short; lower one of them (or raise rollout.max_model_len, if the model allows)")
