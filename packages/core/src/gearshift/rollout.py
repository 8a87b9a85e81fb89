"""The rollout-engine interface: generation, and taking new weights in place.

Prompts are token ids; the RL loop tokenizes. Log-probabilities are those of
the model's own distribution (temperature 1, no top-k/top-p truncation) of
each sampled token, whatever the sampling temperature, so they compare
directly with the train engine's `forward_logprobs`.

Construction (gearshift.options): every rollout engine is built by
`Engine.build(model, **options)` from the common `RolloutArgs` below plus its
own `Options` dataclass, and sets `device`, `mesh` and `max_model_len`. The
rollout mesh covers the same ranks as the train mesh (the planner checks),
unless rollout runs on a pool of its own (`run.placement=split`).

Memory: `sleep(tags)` releases the tagged memory (`weights`, `kv_cache`) and
`wake(tags)` takes it back; sleeping either tag drops the prefix cache;
released weights hold garbage until the next `update_weights`. While any tag
sleeps, `generate` raises `RolloutError`; while the weights sleep,
`update_weights` does too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import torch

from .mesh import MeshSpec
from .options import Buildable, EngineArgs, option
from .tags import ROLLOUT_TAGS, check_tags
from .weights import Adapter, WeightBucket, WeightSpec


@dataclass(frozen=True)
class RolloutArgs(EngineArgs):
    """What every rollout engine is built from (besides its own `Options`)."""

    max_model_len: int | None = option(None, "context length in tokens, prompt and completion together "
                                             "(None: the model's own)")
    max_lora_rank: int = option(0, "serve LoRA adapters up to this rank (`load_adapter`; engines that "
                                   "can_load_adapters only); 0: no adapters")
    max_batch_tokens: int | None = option(None, "tokens one generate call holds at once over every data-parallel "
                                                "replica, prompts and completions of all samples: an engine "
                                                "that reserves a KV cache may size it to this (None: unknown)")


#: a KV cache sized to a batch holds this much more than its tokens: engines round each sequence up to whole
#: blocks, and a prompt may run longer than announced
KV_MARGIN = 1.25


def kv_tokens_for_batch(batch_tokens: int | None, context: int, dp: int = 1) -> int | None:
    """Tokens one of `dp` replicas' KV cache holds for its share of a batch of `batch_tokens`
    (`RolloutArgs.max_batch_tokens`): the share with `KV_MARGIN` more, and at least one sequence of the whole
    `context`; None when the batch is not known."""
    if not batch_tokens:
        return None
    return int(max(-(-batch_tokens // dp), context) * KV_MARGIN)


class RolloutError(ValueError):
    """A request the engine cannot serve; the engine stays usable."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: return each sampled token's logprob; False: nothing will read them, so an engine may skip them and
    #: leave `Rollout.logprobs` empty (an engine spends time on each token's logprob)
    logprobs: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} (samples per prompt) must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if problems:
            raise RolloutError("bad sampling parameters: " + "; ".join(problems))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    `token_ids` and `logprobs` cover every generated token, the one that ended generation included
    (EOS, a stop token id, or the token completing a stop string); `logprobs` may be empty when the
    call asked for none (`SamplingParams.logprobs` False). `text`, when the engine sets it, is
    the decoded completion with special tokens skipped, cut before a stop string; rewards read it when
    set (else the loop decodes `token_ids`).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos, stop token or string) or "length"
    prompt_index: int = 0
    sample_index: int = 0
    text: str | None = None
    extra: dict = field(default_factory=dict)


def text_before_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first of the stop strings in it: a completion's text leaves its stop string out."""
    ends = [text.find(s) for s in stop if s in text]
    return text[:min(ends)] if ends else text


class RolloutEngine(Buildable, ABC):
    """A generator for one causal LM that takes new weights in place between rollouts.

    Subclass it, declare `Options`, implement `__init__(self, args, options)` (call
    `super().__init__(args, options)`; set `device` and `max_model_len`) and the
    abstract methods below.
    """

    Args: ClassVar[type] = RolloutArgs
    required_attributes: ClassVar[dict[str, str]] = {"max_model_len": "a positive int (the context length)"}
    #: the engine can serve from tensors it is handed, without copying them (`share_weights`)
    can_share_weights: ClassVar[bool] = False
    #: `update_weights` takes floating-point tensors of any dtype and casts them as it copies them in
    #: (an engine may set it per instance, where it depends on how the engine was built)
    casts_on_load: bool = False
    #: the engine can serve a LoRA adapter on top of its base weights (`load_adapter`; built with
    #: `max_lora_rank` > 0)
    can_load_adapters: ClassVar[bool] = False

    args: RolloutArgs
    device: torch.device
    mesh: MeshSpec
    max_model_len: int
    #: the tags the caller put to sleep and has not woken since: an engine's `sleep` adds them and its
    #: `wake` takes them away; while any is asleep, `check_prompts` (and so `generate`) raises `RolloutError`
    asleep: set[str]

    def __init__(self, args: RolloutArgs, options: Any = None) -> None:
        if args.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank={args.max_lora_rank} must be >= 0 (0: no adapters)")
        if args.max_lora_rank and not self.can_load_adapters:
            raise ValueError(f"{type(self).__name__} cannot serve LoRA adapters (max_lora_rank="
                             f"{args.max_lora_rank}): sync the merged weights instead (max_lora_rank=0)")
        super().__init__(args, options)
        self.asleep = set()

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped by prompt in order, with temperature-1 logprobs (which an
        engine may leave out when `sampling.logprobs` is False).

        Raises `RolloutError` on input no engine can serve and while any tag sleeps (`check_prompts`
        checks both: call it first).
        """

    @abstractmethod
    def weight_spec(self) -> WeightSpec:
        """The weights the engine takes (`named_parameters()` names, a tied head as an alias), their
        shapes, dtypes and placements."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load the buckets in place; returns the bytes of the tensors handed in.

        Each bucket is checked (`WeightSpec.check`: names, this rank's shapes) before any of it
        is applied: a bad bucket raises `WeightError` and none of it lands. Buckets before it
        stay applied (the error says how many weights were), and the engine keeps serving. The
        prefix cache is dropped once the update ends, however it ends. Raises `RolloutError`
        while the weights sleep.
        """

    def share_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Serve from the buckets' tensors themselves, copying nothing; returns the bytes now borrowed.

        The tensors stay the caller's: the engine only reads them, and the caller must not
        change them while the engine serves (the `HybridActor` trains only after `sleep`, which
        lets go of them). Works whether or not the weights are asleep, since it needs no memory
        of the engine's own, and leaves them awake: the switch does not call `wake(["weights"])`
        after sharing. A bad bucket raises `WeightError` before any of it is taken. A later
        `update_weights` gives the engine its own copy again and never writes into the borrowed
        tensors; `sleep` lets go of them; `resident_bytes()` counts only memory the engine owns.
        Engines that can do this set `can_share_weights = True`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot serve from another engine's tensors")

    def release_sources(self) -> None:
        """Let go of any trainer tensor kept from `update_weights` for the next sync (`WeightBucket.lent`).

        The actor calls it before the trainer offloads its parameters: memory the engine still maps
        (CUDA IPC, shared memory) would not be freed. The next update hands the tensors in again.
        Engines that keep none need not override it.
        """

    def load_adapter(self, adapter: Adapter) -> int:
        """Serve `adapter` on top of the model the engine was built from; returns the bytes of its tensors.

        That model is the trainer's frozen base: an engine whose weights `update_weights` replaced
        since restores it first. A later `update_weights` or `share_weights` hands in a whole
        policy and drops the adapter. Raises `WeightError` on an adapter the engine
        cannot serve (a rank above `max_lora_rank`, a module it has no adapter slot for),
        before any of it is applied, and `RolloutError` while the weights sleep. The prefix
        cache is dropped. An engine built with `max_lora_rank` > 0 keeps its base weights through
        `sleep` (the adapter sync sends none). Engines that can do this set `can_load_adapters = True`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters")

    @abstractmethod
    def sleep(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Release the tagged memory and drop the prefix cache; released weights hold garbage until the next
        `update_weights`."""

    @abstractmethod
    def wake(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Take back the memory `sleep` released (woken weights still need an `update_weights`)."""

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop cached prefixes, which hold keys and values computed with older weights (the switch calls it
        after every sync, so an engine that changes weights in another way stays correct)."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the engine holds now for each tag it can release (empty: not measurable)."""
        return {}

    def close(self) -> None:
        """Release the engine's resources."""

    def check_prompts(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                      vocab_size: int | None = None) -> None:
        """Raise `RolloutError` on input no engine can serve, or while any tag is `asleep`, before any work
        starts."""
        if not isinstance(sampling, SamplingParams):
            raise RolloutError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if len(prompts) == 0:
            raise RolloutError("generate() got an empty list of prompts")
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                raise RolloutError(f"prompt {i} is a string: pass token ids (tokenize it first)")
            if len(p) == 0:
                raise RolloutError(f"prompt {i} is empty")
            if len(p) >= self.max_model_len:
                raise RolloutError(
                    f"prompt {i} has {len(p)} tokens but the context holds {self.max_model_len}: "
                    f"shorten it or raise max_model_len"
                )
            if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
                raise RolloutError(f"prompt {i} has token ids outside [0, {vocab_size})")
        if getattr(self, "asleep", None):
            raise RolloutError(f"the engine's {sorted(self.asleep)} are asleep: call wake() first "
                               f"(and update the weights, which sleep discards)")

    @staticmethod
    def _tags(tags: Sequence[str]) -> list[str]:
        return check_tags(tags, ROLLOUT_TAGS)


__all__ = ["ROLLOUT_TAGS", "Rollout", "RolloutArgs", "RolloutEngine", "RolloutError", "SamplingParams"]
