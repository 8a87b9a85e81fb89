"""The sections of the run config that name the model, the data, the engines, the switch and the reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .base import Section

#: the dtypes an engine holds its weights in (`gearshift.options.DTYPES`)
Dtype = Literal["bfloat16", "float16", "float32"]

#: switch.share -> the `share` flag of the stream resharder (None: when the pair can)
SHARE = {"auto": None, "on": True, "off": False}


def parse_offload(text: str) -> str | list[str]:
    """An offload setting (`switch.offload`, `gearshift bench switch --offload`) as `HybridActor` takes it:
    "auto", or the tags to move ('none': no tag)."""
    text = text.strip()
    if text in ("auto", ""):
        return "auto"
    return [] if text == "none" else [t.strip() for t in text.split(",") if t.strip()]


@dataclass
class LoraConfig(Section):
    """LoRA adapters (through peft), trained in place of the whole model."""

    r: int = 0
    """LoRA rank; 0: no LoRA, every weight trains."""
    alpha: int = 16
    """The adapters are scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names or name suffixes of the layers that get adapters, or all-linear."""
    sync: Literal["merged", "adapter"] = "merged"
    """What a switch sends the rollout engine: merged (W + alpha/r B A, any engine) or adapter (the adapter
    alone, served on the base by an engine that can: vllm)."""

    @property
    def adapter_sync(self) -> bool:
        return bool(self.r) and self.sync == "adapter"

    def train_options(self) -> dict[str, Any]:
        """The options a trainer built on `ModuleTrainEngine` takes for this (none when r is 0)."""
        if not self.r:
            return {}
        return {"lora_r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "lora_target_modules": list(self.target_modules)}

    def problems(self, at: str) -> list[str]:
        found = []
        if self.r < 0:
            found.append(f"{at}r={self.r} must be >= 0 (0: no LoRA)")
        if self.r and self.alpha <= 0:
            found.append(f"{at}alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            found.append(f"{at}dropout={self.dropout} must be in [0, 1)")
        if self.r and not self.target_modules:
            found.append(f"{at}target_modules is empty: name layers (e.g. [q_proj, v_proj]) or use [all-linear]")
        if self.sync == "adapter" and not self.r:
            found.append(f"{at}sync=adapter needs LoRA: set {at}r (e.g. 8)")
        return found


@dataclass
class ModelConfig(Section):
    """The policy's starting model."""

    path: str | None = None
    """A Hugging Face model folder, or a preset built locally ('tiny', 'small', 'small-add', ...); unset, the
    built-in task's model: 'small-calc' for data.task=calc (a tool-calling warm-up), else 'small-add'."""
    dtype: Dtype = "float32"
    """The dtype training holds the weights in."""
    dropout: bool = False
    """Train with the model's dropout; off by default: an on-policy update with it is off-policy."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters only."""


@dataclass
class DataConfig(Section):
    """The prompts: a dataset, or a built-in task."""

    path: str | None = None
    """A jsonl or parquet file with a 'prompt' column; null: the built-in task."""
    task: str = "add"
    """The built-in task when path is null (add, arith, reverse)."""
    task_options: dict[str, Any] = field(default_factory=lambda: {"digits": 1, "second": 1})
    """The built-in task's options."""
    prompt_key: str = "prompt"
    """The column that holds the prompt."""
    max_prompt_len: int = 64
    """Prompts are cut to this many tokens."""
    seed: int = 0
    """Seed of the order the prompts are drawn in."""
    val_path: str | None = None
    """A held-out jsonl/parquet set (same columns) the policy is evaluated on every run.eval_every steps and at
    the end; null: no evaluation."""

    def problems(self, at: str) -> list[str]:
        from ..tasks import TASKS

        found = []
        if self.max_prompt_len < 1:
            found.append(f"{at}max_prompt_len={self.max_prompt_len} must be >= 1")
        if not self.path and self.task not in TASKS:
            found.append(f"{at}task={self.task!r}: built-in tasks are {', '.join(TASKS)} "
                         f"(or set {at}path to a jsonl/parquet file)")
        return found


@dataclass
class RolloutConfig(Section):
    """The rollout engine and how it samples."""

    backend: str = "vllm"
    """A rollout backend ('gearshift backends --kind rollout')."""
    n: int = 8
    """Samples per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature; 0: greedy."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities add up to this."""
    top_k: int = 0
    """Sample among the k likeliest tokens; 0: off."""
    max_tokens: int = 4
    """Tokens a completion may have at most."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion."""
    max_model_len: int | None = None
    """Context of the rollout engine, prompt and completion together; null: the model's own."""
    dtype: Dtype | None = None
    """Dtype of the rollout engine's weights; null: model.dtype, like training."""
    mesh: str | None = None
    """How the engine lies over the ranks, e.g. 'dp=2' or 'tp=2'; null: data parallel over every rank."""
    logprobs: Literal["auto", "always", "never"] = "auto"
    """The engine's logprob of each sampled token: 'auto' asks for them where something reads them (every step
    under a rollout correction, else the first step and every tenth, for the mismatch/* figures); 'always';
    'never'."""
    options: dict[str, Any] = field(default_factory=dict)
    """The engine's own options ('gearshift backends NAME')."""

    def problems(self, at: str) -> list[str]:
        from ...rollout import RolloutError, SamplingParams

        found = []
        try:
            SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           max_tokens=self.max_tokens, stop=tuple(self.stop))
        except RolloutError as err:
            found.append(f"{at.rstrip('.')}: {err}")
        if self.max_model_len is not None and self.max_model_len < 1:
            found.append(f"{at}max_model_len={self.max_model_len} must be >= 1 (or null: the model's own)")
        return found


@dataclass
class TrainConfig(Section):
    """The train engine and how it batches."""

    backend: str = "fsdp"
    """A train backend ('gearshift backends --kind train')."""
    lr: float | None = None
    """The policy's learning rate; null: the algorithm's own (grpo 3e-4, ppo 2e-4)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this."""
    mini_batch_size: int | None = None
    """Sequences per optimizer step, over the whole batch; null: the algorithm's own: grpo takes the whole
    batch in one step, ppo in two (its critic-based advantages gain from a second, slightly off-policy step)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward; null: the whole mini-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Pack sequences by length into micro-batches of this many tokens; null: what the device holds on a GPU,
    1,024 on a CPU (when micro_batch_size is null too)."""
    share_prompts: bool | None = None
    """Compute a prompt once for all its samples (one packed sequence per prompt, the same logprobs and
    gradients up to rounding); null: on a CPU for a batch where packing computes less than running its rows
    apart (short prompts before long answers do not), off on a GPU until measured there. A critic never does."""
    mesh: str | None = None
    """How the engine lies over the ranks, e.g. 'dp=2' or 'dp=2,tp=2'; null: data parallel over every rank."""
    options: dict[str, Any] = field(default_factory=dict)
    """The engine's own options ('gearshift backends NAME')."""

    def problems(self, at: str) -> list[str]:
        found = []
        if self.lr is not None and self.lr <= 0:
            found.append(f"{at}lr={self.lr} must be > 0 (or null: the algorithm's own)")
        for key, meaning in (("mini_batch_size", "the algorithm's own"), ("micro_batch_size", "the mini-batch"),
                             ("max_tokens_per_micro_batch", "off")):
            value = getattr(self, key)
            if value is not None and value < 1:
                found.append(f"{at}{key}={value} must be >= 1 (or null: {meaning})")
        return found


@dataclass
class SwitchConfig(Section):
    """The switch between training and rollout: how the weights travel, what leaves the device."""

    resharder: str = "stream"
    """A reshard backend ('gearshift backends --kind reshard')."""
    share: Literal["auto", "on", "off"] = "auto"
    """Serve rollout from the trainer's own tensors: auto (when the pair can), on, off."""
    bucket_mb: int = 128
    """Weights travel in buckets of about this many MiB."""
    offload: str = "auto"
    """Train state moved to host memory during rollout: auto (on a GPU, only what the rollout engine's memory
    needs, largest first; see gearshift.memory), none, or tags to always move, e.g. optimizer,grads."""
    offload_params: bool = False
    """Also move the trained weights to host during rollout (turns sharing off)."""
    options: dict[str, Any] = field(default_factory=dict)
    """More resharder options."""

    @property
    def share_flag(self) -> bool | None:
        """`share` as the stream resharder takes it."""
        return SHARE[self.share]

    def offload_tags(self) -> str | list[str]:
        """`offload` as `HybridActor` takes it."""
        return parse_offload(self.offload)

    def problems(self, at: str) -> list[str]:
        from ...tags import TRAIN_TAGS

        found = []
        if self.bucket_mb < 1:
            found.append(f"{at}bucket_mb={self.bucket_mb} must be >= 1")
        tags = self.offload_tags()
        unknown = [tag for tag in tags if tag not in TRAIN_TAGS] if tags != "auto" else []
        if unknown:
            found.append(f"{at}offload={self.offload!r}: unknown tags {unknown}; use auto, none, or tags "
                         f"from {list(TRAIN_TAGS)} (e.g. optimizer,grads)")
        if self.share == "on" and self.offload_params:
            found.append(f"{at}share=on with {at}offload_params=true: the rollout engine would read weights "
                         f"that were moved away; drop one")
        return found


@dataclass
class RewardConfig(Section):
    """The reward: a rule (a function), a learned reward model, or both."""

    fn: str | None = None
    """'module:fn' or 'path/to/file.py:fn'; null: the built-in task's own reward (with no model)."""
    model: str | None = None
    """A reward model: a folder or preset ('small-add-rm') of a one-output classifier."""
    weights: list[float] = field(default_factory=lambda: [1.0, 1.0])
    """[fn, model]: how the two rewards add up when a model scores."""
    model_batch_size: int = 32
    """Completions per reward-model forward."""

    def resolved(self, data: DataConfig) -> str:
        """The reward to load: `fn`, or the one that grades the built-in task (`validate` checks there is one)."""
        from ..tasks import TASK_REWARDS

        return self.fn or TASK_REWARDS[data.task]

    def rule(self, data: DataConfig) -> str | None:
        """The rule reward that takes part: `fn`; with no `fn`, the built-in task's own unless a model scores."""
        return self.fn if self.fn or self.model else self.resolved(data)

    def problems(self, at: str) -> list[str]:
        found = []
        if len(self.weights) != 2:
            found.append(f"{at}weights={self.weights}: give two weights, for [fn, model]")
        if self.model_batch_size < 1:
            found.append(f"{at}model_batch_size={self.model_batch_size} must be >= 1")
        return found
