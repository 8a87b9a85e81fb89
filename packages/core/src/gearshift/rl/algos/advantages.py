"""Advantage estimators: rewards -> per-token advantages and returns over the response tokens.

Every estimator has one signature, so the RL loop calls any of them the same way:

    advantages, returns = get_advantage(name)(rewards, mask, group_ids=..., values=..., **options)

rewards    [B] one outcome reward per sequence, or [B, T] per-token rewards
mask       [B, T] 1 on response tokens (the `loss_mask`)
group_ids  [B] samples of the same prompt share an id (`Rollout.prompt_index`)
values     [B, T] critic values; `values[:, t]` is the value of the state in
           which token t is chosen (aligned like `logprobs`)

Both outputs are [B, T] and 0 outside the mask. An estimator ignores the data
it does not use, and raises when data it needs is missing.
"""

from __future__ import annotations

import torch

from .masked import last_token_index, masked_mean, masked_var, whiten
from .registry import ADVANTAGES, register_advantage

__all__ = [
    "compute_advantages", "gae", "group_ids_from_size", "grpo", "outcome_to_token_rewards", "reinforce",
    "rloo", "whiten",
]


def compute_advantages(name: str, rewards: torch.Tensor, mask: torch.Tensor, *,
                       group_ids: torch.Tensor | None = None, values: torch.Tensor | None = None,
                       **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator `name`, rejecting options it does not take (a typo in a config)."""
    ADVANTAGES.check_options(name, options)
    return ADVANTAGES.get(name)(rewards, mask, group_ids=group_ids, values=values, **options)


def group_ids_from_size(batch_size: int, group_size: int) -> torch.Tensor:
    """Ids for a batch laid out as consecutive groups of `group_size` samples per prompt."""
    if group_size < 1 or batch_size % group_size:
        raise ValueError(f"batch of {batch_size} sequences does not split into groups of {group_size}")
    return torch.arange(batch_size) // group_size


def outcome_to_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] outcome rewards placed on each sequence's last response token, as [B, T]."""
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"outcome rewards have shape {tuple(rewards.shape)}, expected [{mask.shape[0]}]")
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def _outcome(name: str, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"{name} takes one outcome reward per sequence, shape [{mask.shape[0]}], got "
            f"{tuple(rewards.shape)}; for per-token rewards (KL in the reward) use 'gae' or 'reinforce', "
            f"or put the KL in the loss"
        )
    return rewards.float()


def _groups(name: str, group_ids: torch.Tensor | None, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's group number (0..G-1) and every group's size."""
    if group_ids is None:
        raise ValueError(f"{name} needs group_ids (which prompt each sample answers); "
                         f"build them with group_ids_from_size(batch, n) or from Rollout.prompt_index")
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected [{batch}]")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


@register_advantage("grpo")
def grpo(rewards, mask, *, group_ids=None, values=None, norm_by_std: bool = True, eps: float = 1e-6):
    """(r - group mean) / (group std + eps) on every response token; `norm_by_std=False` is Dr. GRPO.

    The std is Bessel-corrected; a group of one sample gets advantage 0.
    """
    r = _outcome("grpo", rewards, mask)
    inverse, counts = _groups("grpo", group_ids, r.shape[0])
    counts = counts.to(r.dtype)
    dev = r - (_group_sum(r, inverse, len(counts)) / counts)[inverse]
    if norm_by_std:
        var = _group_sum(dev**2, inverse, len(counts)) / (counts - 1).clamp(min=1)
        scale = var.sqrt()[inverse] + eps
        dev = torch.where(scale > 0, dev / scale, torch.zeros_like(dev))  # eps=0 and equal rewards: 0, not nan
    m = mask.to(r.dtype)
    return dev[:, None] * m, r[:, None] * m


@register_advantage("rloo")
def rloo(rewards, mask, *, group_ids=None, values=None):
    """r minus the mean reward of the other samples of the same prompt (leave-one-out baseline)."""
    r = _outcome("rloo", rewards, mask)
    inverse, counts = _groups("rloo", group_ids, r.shape[0])
    if (counts < 2).any():
        raise ValueError("rloo needs at least 2 samples per prompt (the baseline leaves one out); "
                         "raise the number of samples per prompt (n)")
    n = counts.to(r.dtype)[inverse]
    others = (_group_sum(r, inverse, len(counts))[inverse] - r) / (n - 1)
    m = mask.to(r.dtype)
    return (r - others)[:, None] * m, r[:, None] * m


def _discounted(x: torch.Tensor, mask: torch.Tensor, decay: float,
                values: torch.Tensor | None = None, gamma: float = 1.0) -> torch.Tensor:
    """Right-to-left recursion over the masked tokens: a_t = delta_t + decay * a_next.

    With values, delta_t = x_t + gamma * V_next - V_t (GAE); without, delta_t = x_t
    (discounted reward-to-go). "next" is the next masked token, so padding and
    tokens masked out mid-sequence are skipped, and the value after the last
    response token is 0.
    """
    m = mask.bool()
    out = torch.zeros_like(x)
    carry = x.new_zeros(x.shape[0])
    next_value = x.new_zeros(x.shape[0])
    for t in reversed(range(x.shape[1])):
        delta = x[:, t] if values is None else x[:, t] + gamma * next_value - values[:, t]
        step = delta + decay * carry
        out[:, t] = torch.where(m[:, t], step, torch.zeros_like(step))
        carry = torch.where(m[:, t], step, carry)
        if values is not None:
            next_value = torch.where(m[:, t], values[:, t], next_value)
    return out


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if rewards.dim() == 1:
        return outcome_to_token_rewards(rewards, mask)
    if rewards.shape != mask.shape:
        raise ValueError(f"token rewards have shape {tuple(rewards.shape)}, the mask {tuple(mask.shape)}")
    return rewards.float()


@register_advantage("reinforce")
def reinforce(rewards, mask, *, group_ids=None, values=None, gamma: float = 1.0, baseline: str = "none",
              whiten_advantages: bool = False):
    """Discounted reward-to-go, minus the batch mean when `baseline="batch_mean"`.

    For outcome rewards [B] and gamma 1 the reward-to-go is the reward itself
    on every response token, and the batch-mean baseline is the mean reward.
    """
    if baseline not in ("none", "batch_mean"):
        raise ValueError(f"reinforce baseline {baseline!r}: use 'none' or 'batch_mean'")
    m = mask.to(torch.float32)
    returns = _discounted(_token_rewards(rewards, mask), mask, gamma)
    adv = returns
    if baseline == "batch_mean":
        base = rewards.float().mean() if rewards.dim() == 1 and gamma == 1.0 else masked_mean(returns, m)
        adv = (returns - base) * m
    if whiten_advantages:
        adv = whiten(adv, m)
    return adv, returns


@register_advantage("gae")
def gae(rewards, mask, *, group_ids=None, values=None, gamma: float = 1.0, lam: float = 0.95,
        whiten_advantages: bool = True, center: bool = True):
    """Generalized advantage estimation (PPO) over the response tokens; returns = advantages + values.

    Outcome rewards [B] are placed on the last response token. Advantages
    are whitened over the batch's response tokens by default, returns are not.
    `center=False` only divides them by their standard deviation: the critic is
    the baseline already, and subtracting the batch mean as well would push every
    token, even those whose advantage is 0 (a prompt the policy fails whatever it
    samples), by the same amount.
    """
    if values is None:
        raise ValueError("gae needs the critic's values [B, T]; use a critic (PPO) or pick 'grpo'")
    if values.shape != mask.shape:
        raise ValueError(f"values have shape {tuple(values.shape)}, the mask {tuple(mask.shape)}")
    m = mask.to(torch.float32)
    values = values.float() * m
    adv = _discounted(_token_rewards(rewards, mask), mask, gamma * lam, values=values, gamma=gamma)
    returns = (adv + values) * m
    if whiten_advantages:
        adv = whiten(adv, m) if center else adv * torch.rsqrt(masked_var(adv, m) + 1e-8) * m
    return adv, returns
