"""The algorithm section of the run config: GRPO or PPO, and what their losses and advantages take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Section

#: algorithm.gae_norm -> the options of the gae estimator
GAE_NORMS = {"center_scale": {"whiten_advantages": True, "center": True},
             "scale": {"whiten_advantages": True, "center": False},
             "none": {"whiten_advantages": False}}


@dataclass
class AlgorithmConfig(Section):
    """The RL algorithm: its advantages, its loss, its KL penalty, its corrections."""

    name: Literal["grpo", "ppo"] = "grpo"
    """grpo (advantages from each prompt's group of samples) or ppo (from a learned critic)."""
    advantage: str | None = None
    """A registered advantage estimator (grpo, rloo, reinforce, gae); null: grpo for grpo, gae for ppo."""
    policy_loss: str = "ppo_clip"
    """A registered policy loss (ppo_clip, reinforce)."""
    clip_low: float = 0.2
    """ppo_clip: the ratio's lower clip is 1 - clip_low."""
    clip_high: float = 0.2
    """ppo_clip: the ratio's upper clip is 1 + clip_high."""
    epochs: int = 1
    """Passes over each batch."""
    kl_coef: float = 0.0
    """Weight of the KL divergence from the starting policy (the reference); 0: no reference."""
    kl_estimator: str = "k3"
    """A registered KL estimator: k1, k2 or k3."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: loss, or reward (per token, for advantages that take per-token rewards)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses make the batch's loss."""
    norm_adv_by_std: bool = True
    """grpo: divide each group's advantages by its standard deviation."""
    gamma: float = 1.0
    """GAE (ppo) discount: with outcome rewards, gamma = lam = 1 makes each token's advantage the reward minus
    the critic's value of the state it was chosen in."""
    lam: float = 1.0
    """GAE (ppo) lambda."""
    critic_lr: float = 1e-3
    """ppo: the critic's learning rate (5x the policy's default)."""
    critic_warmup: int = 0
    """ppo: steps that train the critic alone before the policy learns."""
    critic_epochs: int | None = None
    """ppo: passes of the critic over each batch; null: algorithm.epochs."""
    gae_norm: Literal["center_scale", "scale", "none"] = "scale"
    """ppo: advantages over the batch: scale (divide by their std: the critic is the baseline already),
    center_scale (whiten: also subtract their mean) or none."""
    value_clip: float = 0.2
    """ppo: the critic's new values are clipped to within this of the old ones."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Correct for rollout/trainer probability gaps: none, tis (truncated importance weights) or mis (masked:
    samples whose ratio leaves [1/C, C] are dropped)."""
    rollout_correction_level: Literal["token", "sequence", "geometric"] = "token"
    """The ratio corrected: per token, per sequence (the product of its tokens' ratios) or geometric (their
    mean)."""
    rollout_correction_cap: float = 2.0
    """C: tis weights min(ratio, C); mis keeps ratios in [1/C, C]."""
    off_policy_steps: int = 0
    """run.placement=split: rollout of step k+1 runs while step k trains, on samples up to this many updates
    old."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """The trainer's logprobs of the sampled tokens before the update: auto takes them from the training
    forward itself (detached) when the batch trains once, in one mini-batch, with no rollout correction and no
    KL in the reward (the ratio is then exactly 1); recompute always runs the separate forward pass."""

    def estimator(self) -> str:
        """The advantage estimator: `advantage`, or the algorithm's own."""
        return self.advantage or ("gae" if self.name == "ppo" else "grpo")

    def problems(self, at: str) -> list[str]:
        found = []
        if not self.rollout_correction_cap >= 1:
            found.append(f"{at}rollout_correction_cap={self.rollout_correction_cap} must be >= 1 "
                         f"(tis: weights at most C; mis: ratios kept in [1/C, C])")
        for key in ("kl_coef", "entropy_coef", "clip_low", "clip_high"):
            if not getattr(self, key) >= 0:
                found.append(f"{at}{key}={getattr(self, key)} must be >= 0")
        if not self.clip_low < 1:
            found.append(f"{at}clip_low={self.clip_low} must be < 1 (the ratio's lower clip is 1 - clip_low)")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                found.append(f"{at}{key}={getattr(self, key)} must be within [0, 1]")
        for key in ("critic_lr", "value_clip"):
            if not getattr(self, key) > 0:
                found.append(f"{at}{key}={getattr(self, key)} must be > 0")
        for key in ("critic_warmup", "off_policy_steps"):
            if getattr(self, key) < 0:
                found.append(f"{at}{key}={getattr(self, key)} must be >= 0")
        for key in ("epochs", "critic_epochs"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                found.append(f"{at}{key}={getattr(self, key)} must be >= 1")
        if self.kl_in == "reward" and self.kl_coef > 0 and self.estimator() in ("grpo", "rloo"):
            found.append(f"{at}kl_in=reward needs per-token rewards, which {self.estimator()} does not take: "
                         f"set {at}kl_in=loss, or use advantage gae/reinforce")
        return found
