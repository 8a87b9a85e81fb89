"""Policy losses (PPO clip, REINFORCE), the clipped value loss, and builders of `LossFn`s for `train_step`.

A registered policy loss maps per-token tensors to per-token losses:

    token_losses, metrics = get_policy_loss(name)(logprobs, old_logprobs, advantages, mask, **options)

The builders add the KL and entropy terms, aggregate, and read the batch:

    loss_fn = make_policy_loss_fn("ppo_clip", clip_low=0.2, clip_high=0.28, kl_coef=0.001)
    metrics = engine.train_step(batch, loss_fn)

`batch.extras` keys read by the policy loss function:
  advantages     [B, T]  required
  old_logprobs   [B, T]  the logprobs the samples were drawn with; when absent
                         the current logprobs (detached) stand in, which is
                         right only for one optimizer step per rollout batch
  ref_logprobs   [B, T]  the frozen reference; required when the KL is in the loss
  tokens_per_seq [B]     optional, see `aggregate`: exact token means under micro-batching
  rollout_weights [B, T] optional, see `correction.py`: each token's policy-gradient loss is multiplied by it
  rollout_logprobs [B, T] optional: the rollout engine's logprobs of the sampled tokens; their gap to the
                         trainer's is reported (mismatch_mean, mismatch_max), for a step that computes no
                         old logprobs of its own
"""

from __future__ import annotations

import torch

from ...train import LossFn, PolicyOutput, TrainBatch
from .correction import ROLLOUT_WEIGHTS
from .kl import KL_ESTIMATORS, kl_estimate
from .masked import aggregate, check_aggregation, masked_mean
from .registry import POLICY_LOSSES, register_policy_loss

TOKENS_PER_SEQ = "tokens_per_seq"

# exp() of a log-ratio beyond this overflows in half precision and means the sample is far off-policy anyway
_MAX_LOG_RATIO = 20.0


def tokens_per_seq(loss_mask: torch.Tensor) -> torch.Tensor:
    """The [B] extra that makes `token_mean` exact over micro-batches of this (whole step's) batch."""
    mean = loss_mask.float().sum() / loss_mask.shape[0]
    return mean.expand(loss_mask.shape[0]).clone()


@register_policy_loss("ppo_clip")
def ppo_clip(logprobs, old_logprobs, advantages, mask, *, clip_low: float = 0.2, clip_high: float | None = None,
             dual_clip: float | None = None):
    """Clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - old_logp).

    clip_high defaults to clip_low; a larger clip_high (DAPO's "clip higher",
    e.g. 0.28) lets unlikely tokens with positive advantage grow faster.
    dual_clip (> 1, e.g. 3) also bounds the loss of negative-advantage tokens
    by -dual_clip * A, so a huge ratio cannot dominate the step.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"ppo_clip needs 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"ppo_clip dual_clip={dual_clip} must be > 1 (or None to turn it off)")
    m = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(m.dtype), m),
            # k3 estimate of KL(old || new) from tokens sampled from old
            "approx_kl": masked_mean(ratio - 1 - log_ratio, m),
        }
    if dual_clip is not None:
        bound = -advantages * dual_clip
        capped = (advantages < 0) & (losses > bound)
        losses = torch.where(capped, bound, losses)
        metrics["dual_clip_frac"] = masked_mean(capped.to(m.dtype), m)
    return losses, metrics


@register_policy_loss("reinforce")
def reinforce(logprobs, old_logprobs, advantages, mask):
    """-A * logp: the plain policy gradient (no ratio, no clipping)."""
    return -advantages * logprobs, {}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2, agg: str = "token_mean",
               tokens_per_seq: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = old_V + clip(V - old_V, -clip, clip).

    The clipped term keeps one update from moving a value far from the one the
    advantages were computed with; clip=None gives the plain squared error.
    """
    m = mask.to(values.dtype)
    err = (values - returns) ** 2
    metrics: dict[str, torch.Tensor] = {}
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        with torch.no_grad():
            metrics["vf_clip_frac"] = masked_mean((err_clipped > err).to(m.dtype), m)
        err = torch.maximum(err, err_clipped)
    return aggregate(0.5 * err, m, agg, tokens_per_seq), metrics


def _extra(batch: TrainBatch, key: str, why: str) -> torch.Tensor:
    if key not in batch.extras:
        raise KeyError(f"batch.extras has no {key!r} ({why}); the RL loop must attach it to the TrainBatch")
    value = batch.extras[key]
    if value.shape != batch.loss_mask.shape:
        raise ValueError(f"batch.extras[{key!r}] has shape {tuple(value.shape)}, "
                         f"expected {tuple(batch.loss_mask.shape)} like the loss mask")
    return value.to(batch.loss_mask.device)


def make_policy_loss_fn(name: str = "ppo_clip", *, kl_coef: float = 0.0, kl_estimator: str = "k3",
                        kl_in_loss: bool = True, entropy_coef: float = 0.0, agg: str = "token_mean",
                        **loss_options) -> LossFn:
    """A `LossFn` for `TrainEngine.train_step`: policy loss + kl_coef * KL (if in the loss) - entropy_coef * H.

    `loss_options` go to the policy loss (ppo_clip: clip_low, clip_high,
    dual_clip). With kl_in_loss=False the KL belongs in the reward
    (`kl_in_reward`) and is only reported here, when ref_logprobs are given.
    """
    POLICY_LOSSES.check_options(name, loss_options)
    policy_loss = POLICY_LOSSES.get(name)
    KL_ESTIMATORS.get(kl_estimator)
    check_aggregation(agg)
    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"kl_coef ({kl_coef}) and entropy_coef ({entropy_coef}) must be >= 0")
    use_kl = kl_in_loss and kl_coef > 0

    def loss_fn(out: PolicyOutput, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        mask = batch.loss_mask.to(out.logprobs.device, out.logprobs.dtype)
        norm = batch.extras.get(TOKENS_PER_SEQ)
        logp = out.logprobs
        adv = _extra(batch, "advantages", "per-token advantages [B, T]").to(logp.dtype)
        old = _extra(batch, "old_logprobs", "") if "old_logprobs" in batch.extras else logp.detach()
        token_losses, stats = policy_loss(logp, old.to(logp.dtype), adv, mask, **loss_options)
        if ROLLOUT_WEIGHTS in batch.extras:  # rollout correction (tis / mis)
            token_losses = token_losses * _extra(batch, ROLLOUT_WEIGHTS, "").to(logp.dtype)
        pg_loss = aggregate(token_losses, mask, agg, norm)
        loss = pg_loss
        metrics = {"pg_loss": pg_loss.detach(), **{k: _kept(v) for k, v in stats.items()}}
        if "rollout_logprobs" in batch.extras:  # the rollout engine's logprobs beside the trainer's, as drawn
            with torch.no_grad():
                gap = (logp.detach() - _extra(batch, "rollout_logprobs", "").to(logp.dtype)).abs() * mask
                metrics["mismatch_mean"] = aggregate(gap, mask, "token_mean", norm)
                metrics["mismatch_max"] = gap.max() if gap.numel() else 0.0
        if use_kl or "ref_logprobs" in batch.extras:
            ref = _extra(batch, "ref_logprobs", "the reference model's logprobs, for the KL term")
            kl = aggregate(kl_estimate(logp, ref.to(logp.dtype), kl_estimator), mask, agg, norm)
            metrics["kl"] = kl.detach()
            if use_kl:
                loss = loss + kl_coef * kl
        if entropy_coef > 0 and out.entropy is None:
            raise ValueError("entropy_coef > 0 but the engine returned no entropy; set entropy_coef=0 "
                             "or use an engine that computes entropy in train_step")
        if out.entropy is not None:
            entropy = aggregate(out.entropy, mask, agg, norm)
            metrics["entropy"] = entropy.detach()
            if entropy_coef > 0:
                loss = loss - entropy_coef * entropy
        return loss, metrics

    return loss_fn


def _kept(value):
    """A metric as the loss computed it: a tensor stays on its device (detached), so that the engine reads every
    micro-batch's metrics in one transfer after the last, instead of waiting for each before its backward."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def make_value_loss_fn(*, clip: float | None = 0.2, agg: str = "token_mean", coef: float = 1.0) -> LossFn:
    """A `LossFn` for a critic: reads `out.values` and extras `old_values` [B, T] and `returns` [B, T]."""
    check_aggregation(agg)

    def loss_fn(out: PolicyOutput, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        if out.values is None:
            raise ValueError("the engine returned no values: train the critic on an engine with a value head")
        old = _extra(batch, "old_values", "the critic's values when the advantages were computed")
        returns = _extra(batch, "returns", "the returns from the advantage estimator")
        loss, stats = value_loss(out.values, old.to(out.values.dtype), returns.to(out.values.dtype),
                                 batch.loss_mask.to(out.values.device), clip=clip, agg=agg,
                                 tokens_per_seq=batch.extras.get(TOKENS_PER_SEQ))
        metrics = {"vf_loss": loss.detach(), **{k: _kept(v) for k, v in stats.items()}}
        return coef * loss, metrics

    return loss_fn
