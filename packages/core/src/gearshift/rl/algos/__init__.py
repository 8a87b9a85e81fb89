"""RL algorithms as small registered functions: advantage estimators, policy losses, KL estimators.

    from gearshift.rl.algos import compute_advantages, make_policy_loss_fn

    adv, returns = compute_advantages("grpo", rewards, batch.loss_mask, group_ids=prompt_index)
    batch.extras["advantages"] = adv
    engine.train_step(batch, make_policy_loss_fn("ppo_clip", clip_high=0.28))

Add an estimator or a loss with `@register_advantage("name")` /
`@register_policy_loss("name")` in your own code; configs then name it.
"""

from .registry import (  # first: the modules below register into it
    ADVANTAGES, POLICY_LOSSES, Registry, get_advantage, get_policy_loss, register_advantage, register_policy_loss,
)
from .advantages import compute_advantages, gae, group_ids_from_size, grpo, outcome_to_token_rewards, rloo
from .correction import (
    CORRECTIONS, LEVELS as CORRECTION_LEVELS, ROLLOUT_WEIGHTS, check_correction, rollout_correction,
)
from .kl import KL_ESTIMATORS, kl_estimate, kl_in_reward, kl_k1, kl_k2, kl_k3
from .losses import (
    TOKENS_PER_SEQ, make_policy_loss_fn, make_value_loss_fn, ppo_clip, tokens_per_seq, value_loss,
)
from .masked import AGGREGATIONS, aggregate, masked_mean, masked_var, whiten

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "CORRECTIONS", "CORRECTION_LEVELS", "KL_ESTIMATORS", "POLICY_LOSSES",
    "ROLLOUT_WEIGHTS", "Registry", "TOKENS_PER_SEQ", "aggregate", "check_correction", "compute_advantages", "gae",
    "get_advantage", "get_policy_loss", "group_ids_from_size", "grpo", "kl_estimate", "kl_in_reward", "kl_k1",
    "kl_k2", "kl_k3", "make_policy_loss_fn", "make_value_loss_fn", "masked_mean", "masked_var",
    "outcome_to_token_rewards", "ppo_clip", "register_advantage", "register_policy_loss", "rloo",
    "rollout_correction", "tokens_per_seq", "value_loss", "whiten",
]
