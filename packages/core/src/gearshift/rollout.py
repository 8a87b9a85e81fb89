"""The rollout-engine interface: generation, and taking new weights in place.

Prompts are token ids; the RL loop tokenizes. Log-probabilities are those of
the model's own distribution (temperature 1, no top-k/top-p truncation) of
each sampled token, so they compare directly with the train engine's
`forward_logprobs`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Sequence

import torch

from .mesh import MeshSpec
from .train import check_tags
from .weights import WeightBucket, WeightSpec

ROLLOUT_TAGS = ("weights", "kv_cache")


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
    """One sampled completion of one prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos, stop token or string) or "length"
    prompt_index: int = 0
    sample_index: int = 0
    text: str | None = None
    extra: dict = field(default_factory=dict)


class RolloutEngine(ABC):
    """A generator for one causal LM that takes new weights in place between rollouts."""

    requires: ClassVar[tuple[str, ...]] = ()
    install: ClassVar[str] = ""
    #: the engine can serve from tensors it is handed, without copying them (`share_weights`)
    can_share_weights: ClassVar[bool] = False
    #: `update_weights` takes floating-point tensors of any dtype and casts them as it copies them in
    casts_on_load: ClassVar[bool] = False

    device: torch.device
    mesh: MeshSpec
    max_model_len: int

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped by prompt in order."""

    @abstractmethod
    def weight_spec(self) -> WeightSpec:
        """The weights the engine takes (Hugging Face names), their shapes, dtypes and placements."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load the buckets in place and reset the cache; a bad bucket raises before any of it is applied."""

    def share_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Serve from the buckets' tensors themselves, copying nothing; returns the bytes now borrowed.

        The tensors stay the caller's: the engine only reads them, and the caller must not
        change them while the engine serves (the `HybridActor` trains only after `sleep`, which
        lets go of them). Works whether or not the weights are asleep, since it needs no memory
        of the engine's own. A bad bucket raises `WeightError` before any of it is taken.
        A later `update_weights` first gives the engine its own copy again.
        Engines that can do this set `can_share_weights = True`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot serve from another engine's tensors")

    @abstractmethod
    def sleep(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Release the tagged memory; released weights hold garbage until the next `update_weights`."""

    @abstractmethod
    def wake(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Take back the memory `sleep` released."""

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop cached prefixes, which hold keys and values computed with older weights."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the engine holds now for each tag it can release (empty: not measurable)."""
        return {}

    def close(self) -> None:
        """Release the engine's resources."""

    def check_prompts(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                      vocab_size: int | None = None) -> None:
        """Raise `RolloutError` on input no engine can serve, before any work starts."""
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

    @staticmethod
    def _tags(tags: Sequence[str]) -> list[str]:
        return check_tags(tags, ROLLOUT_TAGS)
