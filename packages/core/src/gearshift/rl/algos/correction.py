"""Rollout correction: the rollout engine's and the trainer's probabilities of the same sampled tokens differ.

The rollout engine samples with its own kernels and dtype (a bf16 engine
beside fp32 training, say), so its probability of a token, pi_rollout, is not
quite the trainer's pi_old for the same weights, while the policy loss takes the
samples as drawn from pi_old. The importance ratio rho = pi_old / pi_rollout
turns them into samples of pi_old; since it can be large, it is bounded by a
cap C:

none  no correction (the ratios are still measured and reported)
tis   truncated importance sampling: each token's policy loss weighted by min(rho, C)
mis   masked importance sampling (IcePop): a token whose rho leaves [1/C, C] is dropped (weight 0),
      the others keep weight 1

Levels, which ratio is compared with the cap:

token      each token's own rho_t
sequence   the sequence's product prod_t rho_t = exp(sum_t log rho_t), applied to each of its tokens:
           the exact importance weight of the whole sample (the sequence is what was sampled), so
           before truncation it is unbiased; it drifts away from 1 exponentially with the length,
           so on long answers it is truncated or masked more often
geometric  the sequence's geometric mean exp(mean_t log rho_t): not an importance weight, but a
           per-token average that does not grow with the length, for masking whole sequences that
           are off on average (long answers under mis)

Weights carry no gradient and multiply the per-token policy-gradient loss only
(not the KL or entropy terms). Dropped tokens stay in the denominator of a
token mean, as IcePop normalises: they contribute nothing, and the remaining
tokens are not scaled up to make up for them.
"""

from __future__ import annotations

import math

import torch

from .masked import masked_mean

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")

#: the `TrainBatch.extras` key the policy loss reads the weights from ([B, T])
ROLLOUT_WEIGHTS = "rollout_weights"

# ratios beyond e^20 overflow in half precision; the cap decides long before that
_MAX_LOG_RATIO = 20.0


def check_correction(mode: str, level: str = "token", cap: float = 2.0) -> None:
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: use one of {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"rollout correction level {level!r}: use one of {', '.join(LEVELS)}")
    if not cap >= 1:
        raise ValueError(f"rollout correction cap {cap} must be >= 1 (tis: weights at most C; mis: ratios "
                         f"kept in [1/C, C])")


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "tis", level: str = "token",
                       cap: float = 2.0) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Per-token weights [B, T] for the policy loss (None for `none`), and what they did.

    old_logprobs      [B, T] the trainer's logprobs of the sampled tokens (pi_old)
    rollout_logprobs  [B, T] the rollout engine's logprobs of the same tokens (pi_rollout)
    mask              [B, T] 1 on response tokens

    Metrics, over the response tokens (sequence levels: over the sequences):
    ratio_mean, ratio_max, ratio_min of rho at the level; masked_frac, the share of response
    tokens whose weight is 0 (mis); truncated_frac, the share whose weight was capped (tis);
    weight_mean, the mean weight over response tokens.
    """
    check_correction(mode, level, cap)
    m = mask.to(torch.float32)
    log_ratio = ((old_logprobs.float() - rollout_logprobs.float()) * m).detach()
    if level == "token":
        level_log = log_ratio
        measured = log_ratio[m.bool()]
    else:
        per_seq = log_ratio.sum(-1)
        if level == "geometric":
            per_seq = per_seq / m.sum(-1).clamp(min=1)
        level_log = per_seq[:, None].expand_as(log_ratio)
        measured = per_seq[m.sum(-1) > 0]
    ratio = torch.exp(level_log.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    measured = torch.exp(measured.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    some = measured.numel() > 0
    metrics = {
        "ratio_mean": float(measured.mean()) if some else 1.0,
        "ratio_max": float(measured.max()) if some else 1.0,
        "ratio_min": float(measured.min()) if some else 1.0,
        "masked_frac": 0.0, "truncated_frac": 0.0, "weight_mean": 1.0,
    }
    if mode == "none":
        return None, metrics
    log_cap = math.log(cap)
    if mode == "tis":
        capped = level_log > log_cap
        weights = torch.where(capped, torch.full_like(ratio, cap), ratio) * m
        metrics["truncated_frac"] = float(masked_mean(capped.float(), m))
    else:
        kept = level_log.abs() <= log_cap
        weights = kept.float() * m
        metrics["masked_frac"] = float(masked_mean((~kept).float(), m))
    metrics["weight_mean"] = float(masked_mean(weights, m))
    return weights, metrics
