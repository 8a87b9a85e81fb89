"""One rank's learning step: from scored rollouts to an update of the policy (and critic).

The trainer's logprobs of the sampled tokens, the rollout correction, the
reference's logprobs and KL, the critic's values, advantages, then the policy
(and critic) update over mini-batches. The colocated controller runs it on
every rank after the rollout; with training on its own pool
(`run.placement=split`), every train worker runs it on the groups it is given.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, ContextManager, Sequence

import torch

from ..flops import add_flops, engine_train_flops, train_rates
from ..rollout import Rollout
from ..train import TrainBatch, TrainEngine
from .algos import (
    ROLLOUT_WEIGHTS, TOKENS_PER_SEQ, compute_advantages, kl_estimate, kl_in_reward, make_policy_loss_fn,
    make_value_loss_fn, rollout_correction, tokens_per_seq,
)
from .config import GAE_NORMS, Config

Timed = Callable[[str], ContextManager]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def response_logprobs(rollouts: Sequence[Rollout], values: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    """Per-token values of each rollout's response tokens placed as a `TrainBatch` aligns them ([B, T] like `like`)."""
    out = torch.zeros_like(like)
    for i, (x, v) in enumerate(zip(rollouts, values)):
        out[i, len(x.prompt_ids):len(x.prompt_ids) + len(x.token_ids)] = torch.tensor(v, dtype=out.dtype)
    return out


def episode_loss_mask(rollouts: Sequence[Rollout], mask: torch.Tensor) -> torch.Tensor:
    """`mask` AND each episode's own loss mask (`Rollout.extra["loss_mask"]`: 1 on the model's tokens, 0 on a
    tool's or an environment's), so those tokens carry no loss, KL or entropy and weigh in no advantage
    statistics; single completions keep `mask` as it is."""
    from .agent import LOSS_MASK

    if not any(LOSS_MASK in x.extra for x in rollouts):
        return mask
    own = [x.extra.get(LOSS_MASK, [1] * len(x.token_ids)) for x in rollouts]
    for x, m in zip(rollouts, own):
        if len(m) != len(x.token_ids):
            raise ValueError(f"an episode's loss mask has {len(m)} entries for its {len(x.token_ids)} tokens")
    return mask * response_logprobs(rollouts, own, mask)


def policy_loss_of(config: Config):
    """The loss `algorithm` names, its options checked (the loss, the KL estimator and their options)."""
    a = config.algorithm
    return make_policy_loss_fn(
        a.policy_loss, kl_coef=a.kl_coef if a.kl_in == "loss" else 0.0, kl_estimator=a.kl_estimator,
        kl_in_loss=a.kl_in == "loss", entropy_coef=a.entropy_coef, agg=a.loss_agg,
        **({"clip_low": a.clip_low, "clip_high": a.clip_high} if a.policy_loss == "ppo_clip" else {}),
    )


def check_algorithm(config: Config) -> None:
    """The estimator, loss and KL estimator `algorithm` names are registered, before anything is built (a
    name registered from Python, or by a module the run imports, counts once it is registered)."""
    from .algos import ADVANTAGES
    from .config import ConfigError

    try:
        ADVANTAGES.get(config.algorithm.estimator())
    except ValueError as err:
        raise ConfigError(f"algorithm.advantage: {err}") from None
    try:
        policy_loss_of(config)
    except ValueError as err:  # the loss, its options or the KL estimator
        raise ConfigError(f"algorithm: {err}") from None


class Learner:
    """The policy, and the reference and critic when the algorithm has them, and how one step updates them."""

    def __init__(self, config: Config, policy: TrainEngine, reference: TrainEngine | None = None,
                 critic: TrainEngine | None = None, pad_id: int = 0) -> None:
        a = config.algorithm
        self.config, self.policy, self.reference, self.critic, self.pad_id = config, policy, reference, critic, pad_id
        self.advantage = a.estimator()
        self.policy_loss = policy_loss_of(config)
        self.value_loss = make_value_loss_fn(clip=a.value_clip, agg=a.loss_agg) if critic else None

    def engines(self) -> dict[str, TrainEngine]:
        """The engines a checkpoint holds (the reference never changes, so it is not among them)."""
        engines = {"policy": self.policy}
        if self.critic is not None:
            engines["critic"] = self.critic
        return engines

    def learn(self, kept: list[Rollout], rewards: list[float], step: int, timed: Timed,
              ref_logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, float]:
        """Update on `kept` (rollouts grouped by `prompt_index`) scored `rewards`; `step` counts the updates so
        far. `ref_logprobs` are the reference's logprobs of each response's tokens when another pool computed
        them (else the reference here does, when the algorithm has KL)."""
        cfg, a = self.config, self.config.algorithm
        batch = TrainBatch.from_sequences([x.prompt_ids for x in kept], [x.token_ids for x in kept],
                                          pad_id=self.pad_id)
        batch.loss_mask = episode_loss_mask(kept, batch.loss_mask)  # an episode's tool/environment tokens: 0
        mask = batch.loss_mask
        group_ids = torch.tensor([x.prompt_index for x in kept])
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        rollout_lp = self._rollout_logprobs(kept, mask)
        out: dict[str, float] = {}
        # as many optimizer steps on every rank (their gradients are averaged): the same count of mini-batches
        # of this rank's share, in order, so a prompt's samples stay together
        mini_size = -(-batch.size // max(1, min(cfg.mini_batches(), batch.size)))
        reused = mini_size if self._reusable() else 0  # leading rows whose training forward gives the old logprobs
        extras: dict[str, torch.Tensor] = {}
        if reused and rollout_lp is not None:
            extras["rollout_logprobs"] = rollout_lp
        old = None
        if reused < batch.size:
            with timed("old_logprobs"):
                lp = self.policy.forward_logprobs(batch.select(slice(reused, None))).logprobs.cpu()
            old = torch.zeros_like(mask)
            old[reused:, :lp.shape[1]] = lp
            extras["old_logprobs"] = old
            if rollout_lp is not None:  # the step's rollout brought them (`rollout.logprobs`)
                rest = mask.clone()
                rest[:reused] = 0
                gap = (old - rollout_lp).abs() * rest
                out.update({"mismatch/logprob_max": float(gap.max()), "mismatch/logprob_sum": float(gap.sum()),
                            "mismatch/tokens": float(rest.sum())})
                weights, corrected = rollout_correction(old, rollout_lp, rest, mode=a.rollout_correction,
                                                        level=a.rollout_correction_level,
                                                        cap=a.rollout_correction_cap)
                out.update({f"rollout_correction/{k}": v for k, v in corrected.items()})
                if weights is not None:
                    extras[ROLLOUT_WEIGHTS] = weights
        token_rewards = reward_t
        ref = None
        if ref_logprobs is not None:
            ref = response_logprobs(kept, ref_logprobs, mask)
        elif self.reference is not None:
            with timed("ref_logprobs"):
                ref = self.reference.forward_logprobs(batch).logprobs.cpu()
        if ref is not None:
            extras["ref_logprobs"] = ref
            if not reused:  # else the train step reports it (its logprobs are the old ones)
                out["kl/ref"] = float((kl_estimate(old, ref, a.kl_estimator) * mask).sum() / mask.sum().clamp(min=1))
            if a.kl_in == "reward":
                token_rewards, _ = kl_in_reward(reward_t, mask, old, ref, kl_coef=a.kl_coef, estimator=a.kl_estimator)
        values = None
        if self.critic is not None:
            with timed("values"):
                values = self.critic.forward_logprobs(batch).values.cpu() * mask
            extras["old_values"] = values
        options = {"gamma": a.gamma, "lam": a.lam, **GAE_NORMS[a.gae_norm]} if self.advantage == "gae" else {}
        if self.advantage == "grpo":
            options["norm_by_std"] = a.norm_adv_by_std
        adv, returns = compute_advantages(self.advantage, token_rewards, mask, group_ids=group_ids,
                                          values=values, **options)
        extras.update(advantages=adv, returns=returns)
        batch.extras.update(extras)
        train_metrics: list[dict[str, float]] = []
        # the critic's warm-up: its first steps train the critic alone, so that the first policy updates
        # get advantages from values fitted to this policy's returns rather than from an untrained head
        policy_learns = self.critic is None or step >= a.critic_warmup
        if values is not None:
            # how much of the returns' variance the critic's values explain (1: all; 0: no better than a constant)
            m = mask.bool()
            var = returns[m].var() if m.sum() > 1 else returns.new_zeros(())
            out["critic/explained_var"] = float(1 - (returns - values)[m].var() / var) if var > 0 else 0.0
            out["critic/values_mean"] = float(values[m].mean()) if m.any() else 0.0
        critic_epochs = a.critic_epochs or a.epochs
        trained: list[tuple[TrainEngine, list[int]]] = []  # each train step's engine and row lengths
        start = time.perf_counter()
        with timed("train"):
            for epoch in range(max(a.epochs, critic_epochs)):
                for index, mini in enumerate(batch.micro_batches(mini_size)):
                    if reused and (epoch, index) == (0, 0):  # its own forward, before any update, is the old one
                        mini.extras.pop("old_logprobs", None)
                    else:  # the mismatch is measured before the update only: here, by the separate pass
                        mini.extras.pop("rollout_logprobs", None)
                    # exact token means across micro-batches need each mini-batch's token counts
                    mini.extras[TOKENS_PER_SEQ] = tokens_per_seq(mini.loss_mask)
                    metrics: dict[str, float] = {}
                    if policy_learns and epoch < a.epochs:
                        metrics.update(self.policy.train_step(mini, self.policy_loss))
                        trained.append((self.policy, mini.lengths.tolist()))
                    if self.critic is not None and epoch < critic_epochs:
                        critic_m = self.critic.train_step(mini, self.value_loss)
                        metrics.update({f"critic/{k}": v for k, v in critic_m.items()})
                        trained.append((self.critic, mini.lengths.tolist()))
                    train_metrics.append(metrics)
        seconds = time.perf_counter() - start  # `timed` waits for the device: the phase's time/train
        flops: float | None = 0.0  # its model FLOPs (None: an engine's model has no count)
        for engine, lengths in trained:
            flops = add_flops(flops, engine_train_flops(engine, lengths))
        if flops:
            out.update(train_rates(flops, seconds, self.policy.device))
        keys = {k for m in train_metrics for k in m}
        out.update({f"train/{k}": _mean([m[k] for m in train_metrics if k in m]) for k in sorted(keys)})
        if rollout_lp is not None:
            self._mismatch_figures(out, mask, reused)
        if reused and "train/kl" in out:
            out["kl/ref"] = out["train/kl"]
        return out

    def _rollout_logprobs(self, kept: list[Rollout], mask: torch.Tensor) -> torch.Tensor | None:
        """The rollout engine's logprobs of the sampled tokens placed like `mask`, or None where the rollout
        asked for none (`SamplingParams.logprobs`); a rollout correction cannot do without them."""
        if all(len(x.logprobs) == len(x.token_ids) for x in kept):
            return response_logprobs(kept, [x.logprobs for x in kept], mask)
        if self.config.algorithm.rollout_correction != "none":
            raise ValueError(f"algorithm.rollout_correction={self.config.algorithm.rollout_correction} needs the "
                             f"rollout engine's logprob of every sampled token, and this step's rollouts came "
                             f"without them (rollout.logprobs)")
        return None

    @staticmethod
    def _mismatch_figures(out: dict[str, float], mask: torch.Tensor, reused: int) -> None:
        """The rollout-trainer logprob gap over every token: the training forward's figures for the reused rows
        (its mean over their tokens), the separate pass's for the rest."""
        first = float(mask[:reused].sum())
        mean, top = out.pop("train/mismatch_mean", 0.0), out.pop("train/mismatch_max", 0.0)
        total, tokens = mean * first, first
        if "mismatch/tokens" in out:
            total, tokens = total + out.pop("mismatch/logprob_sum"), tokens + out.pop("mismatch/tokens")
            top = max(top, out["mismatch/logprob_max"])
        out["mismatch/logprob_mean"] = total / max(tokens, 1.0)
        out["mismatch/logprob_max"] = top

    def reuses_old_logprobs(self) -> bool:
        """Whether the step takes all its old logprobs from the training forward, with no pass of their own:
        the batch trains once, in one mini-batch, so the logprobs before the update are those the update's
        forward computes."""
        return self.config.mini_batches() == 1 and self._reusable()

    def _reusable(self) -> bool:
        """Whether the first mini-batch's training forward gives its old logprobs: the batch trains once and
        nothing needs them before the update (no rollout correction, no KL in the reward). With several
        mini-batches the separate pass then runs over the others, which train after an update."""
        a = self.config.algorithm
        return (a.old_logprobs == "auto" and a.epochs == 1
                and (self.critic is None or (a.critic_epochs or a.epochs) == 1)
                and a.rollout_correction == "none" and not (a.kl_in == "reward" and a.kl_coef > 0))
