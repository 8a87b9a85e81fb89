"""Per-token estimators of KL(policy || reference) from samples of the policy, and KL in the reward.

With log-ratio x = logp - ref_logp on tokens sampled from the policy
(Schulman, "Approximating KL Divergence", 2020):

k1 = x                          unbiased, high variance, can be negative
k2 = x^2 / 2                    biased, low variance, >= 0
k3 = exp(-x) - 1 + x            unbiased, low variance, >= 0
   = exp(ref - logp) - (ref - logp) - 1
"""

from __future__ import annotations

import torch

from .advantages import outcome_to_token_rewards
from .registry import Registry

KL_ESTIMATORS = Registry("KL estimator", data=("logprobs", "ref_logprobs"))


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate [B, T] by the estimator named `k1`, `k2` or `k3`."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


def kl_in_reward(rewards: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 *, kl_coef: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards [B, T]: the outcome reward [B] on the last response token minus kl_coef * KL on every one.

    Returns (token_rewards, kl) with the per-token KL [B, T], both 0 outside
    the mask. Feed the token rewards to `gae` or `reinforce`. k1 is the usual
    choice here: summed over a sequence it is that sequence's log-ratio.
    """
    m = mask.to(torch.float32)
    kl = kl_estimate(logprobs.float(), ref_logprobs.float(), estimator) * m
    return outcome_to_token_rewards(rewards, mask) - kl_coef * kl, kl
