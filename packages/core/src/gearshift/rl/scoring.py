"""Scoring rollouts: the rule reward on each completion and its row, a reward model's scores, or both.

A sample whose rule reward is None is dropped. With a reward model the two
are mixed by `reward.weights` ([fn, model]); its scores come from the model
here, or, when another process ran it (a pool's worker), are passed in.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from ..rollout import Rollout
from .config import Config


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


class Scorer:
    """Turns rollouts of a batch of rows into the samples kept and their rewards."""

    def __init__(self, config: Config, tokenizer, reward_fn: Callable[..., Any] | None, reward_model=None) -> None:
        self.config, self.tokenizer, self.reward_fn, self.reward_model = config, tokenizer, reward_fn, reward_model
        self.metrics: dict[str, float] = {}  # of the last batch scored with a reward model

    def decode(self, rollouts: Sequence[Rollout]) -> None:
        """Fill in each rollout's `text` where the engine left it out."""
        for x in rollouts:
            if x.text is None:
                x.text = self.tokenizer.decode(x.token_ids, skip_special_tokens=True)

    def model_scores(self, rollouts: Sequence[Rollout], rows: Sequence[dict]) -> list[float]:
        """The reward model's score of each rollout's prompt and completion."""
        self.decode(rollouts)
        prompts = [rows[x.prompt_index][self.config.data.prompt_key] for x in rollouts]
        return self.reward_model.score(prompts, [x.text for x in rollouts])

    def _rule(self, x: Rollout, row: dict) -> float | None:
        """The rule reward of one completion (checked: a finite float, or None to drop the sample)."""
        if self.reward_fn is None:
            from .rewards import RewardError

            raise RewardError(f"{getattr(row, 'origin', '') or 'a row'}: its episode's environment gave no reward "
                              "and no reward.fn is set to score it: have Environment.step return a reward on every "
                              "turn (the turn and token limits can end an episode after any), or set reward.fn")
        return self.reward_fn(x.text, **{k: v for k, v in row.items() if k != "prompt_ids"})

    def score(self, rollouts: list[Rollout], rows: list[dict],
              learned: Sequence[float] | None = None) -> tuple[list[Rollout], list[float]]:
        """The rollouts kept and their rewards; `learned`: reward-model scores computed elsewhere."""
        from .reward_model import combine

        self.decode(rollouts)
        values = None
        if (self.reward_fn is not None or (self.reward_model is None and learned is None)
                or any("reward" in x.extra for x in rollouts)):
            # an episode's environment owns its reward when it gave one; the rule scores the rest
            values = [x.extra["reward"] if "reward" in x.extra else self._rule(x, rows[x.prompt_index])
                      for x in rollouts]
        if self.reward_model is not None or learned is not None:
            start = time.perf_counter()
            if learned is None:
                learned = self.model_scores(rollouts, rows)
            self.metrics = {"time/reward_model": time.perf_counter() - start, "reward/model_mean": _mean(list(learned))}
            if values is not None:
                self.metrics["reward/fn_mean"] = _mean([v for v in values if v is not None])
            values = combine(values, learned, self.config.reward.weights)
        kept = [(x, v) for x, v in zip(rollouts, values) if v is not None]
        return [x for x, _ in kept], [v for _, v in kept]
