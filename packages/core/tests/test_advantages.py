import math

import pytest
import torch

from gearshift.rl.algos import compute_advantages, gae, group_ids_from_size, grpo, outcome_to_token_rewards, rloo, whiten
from gearshift.rl.algos.advantages import reinforce

# one prompt token, then response tokens; row 2 is padded at the end
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_grpo_normalises_within_each_group_and_broadcasts_over_response_tokens():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    mask = torch.ones(6, 3)
    mask[1, 2] = 0
    adv, returns = grpo(rewards, mask, group_ids=torch.tensor([0, 0, 0, 0, 1, 1]), eps=0.0)
    # group 0: mean 0.5, Bessel std sqrt(1/3); group 1: all equal -> 0
    a = 0.5 / math.sqrt(1 / 3)
    close(adv[:, 0], [a, -a, -a, a, 0, 0])
    close(adv[1], [-a, -a, 0])  # masked-out token stays 0
    close(returns[:, 0], rewards)


def test_grpo_without_std_is_the_plain_group_centred_reward():
    rewards = torch.tensor([3.0, 1.0, 5.0, 5.0])
    adv, _ = grpo(rewards, torch.ones(4, 2), group_ids=torch.tensor([7, 7, 3, 3]), norm_by_std=False)
    close(adv[:, 1], [1.0, -1.0, 0.0, 0.0])


def test_grpo_group_of_one_gets_zero_not_nan():
    adv, _ = grpo(torch.tensor([4.0, 1.0, 0.0]), torch.ones(3, 2), group_ids=torch.tensor([0, 1, 1]))
    assert torch.isfinite(adv).all()
    close(adv[0], [0.0, 0.0])


def test_grpo_needs_groups_and_outcome_rewards():
    with pytest.raises(ValueError, match="needs group_ids"):
        grpo(torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="one outcome reward per sequence.*'gae' or 'reinforce'"):
        grpo(torch.ones(2, 3), torch.ones(2, 3), group_ids=torch.tensor([0, 0]))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv, _ = rloo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, 1), group_ids=group_ids_from_size(4, 4))
    close(adv[:, 0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        rloo(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 1), group_ids=torch.tensor([0, 0, 1]))


def test_group_ids_from_size():
    assert group_ids_from_size(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="does not split into groups of 4"):
        group_ids_from_size(6, 4)


def test_reinforce_outcome_with_and_without_batch_baseline():
    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0])
    adv, returns = reinforce(rewards, MASK)
    close(adv, rewards[:, None] * MASK)
    close(returns, rewards[:, None] * MASK)
    adv, _ = reinforce(rewards, MASK, baseline="batch_mean")
    close(adv, (rewards - 1.0)[:, None] * MASK)


def test_reinforce_token_rewards_are_discounted_right_to_left_skipping_masked_out_tokens():
    mask = torch.tensor([[0.0, 1, 1, 1], [1, 1, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 1], [1, 0, 5, 2]])
    adv, returns = reinforce(rewards, mask, gamma=0.5)
    # row 1: t3 = 2; t2 is masked out (its reward ignored); t1 = 0 + 0.5 * 2; t0 = 1 + 0.5 * 1
    close(returns, [[0.0, 0.25, 0.5, 1.0], [1.5, 1.0, 0.0, 2.0]])
    close(adv, returns)


def test_gae_matches_hand_computation():
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0, 0, 1], [0, 0, 2, 0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7], [9, 0.2, 0.4, 99]])  # prompt and padding values are ignored
    adv, returns = gae(rewards, mask, values=values, gamma=0.9, lam=0.8, whiten_advantages=False)
    # row 0: d3 = 1 - .7 = .3; d2 = .9*.7 - .6 = .03; d1 = .9*.6 - .5 = .04; A = d + .72 * A_next
    a3, a2 = 0.3, 0.03 + 0.72 * 0.3
    a1 = 0.04 + 0.72 * a2
    # row 1: d2 = 2 - .4 = 1.6; d1 = .9*.4 - .2 = .16
    b2, b1 = 1.6, 0.16 + 0.72 * 1.6
    close(adv, [[0, a1, a2, a3], [0, b1, b2, 0]])
    close(returns, [[0, a1 + 0.5, a2 + 0.6, a3 + 0.7], [0, b1 + 0.2, b2 + 0.4, 0]])


def test_gae_with_gamma_lam_one_is_monte_carlo_return_minus_value():
    values = torch.rand(4, 4)
    rewards = torch.tensor([1.0, -1.0, 0.5, 2.0])
    adv, returns = gae(rewards, MASK, values=values, gamma=1.0, lam=1.0, whiten_advantages=False)
    close(returns, rewards[:, None] * MASK)
    close(adv, (rewards[:, None] - values) * MASK)


def test_gae_whitens_advantages_over_response_tokens_by_default():
    adv, _ = gae(torch.tensor([1.0, 0.0, 3.0, 2.0]), MASK, values=torch.rand(4, 4))
    n = MASK.sum()
    mean = (adv * MASK).sum() / n
    var = (((adv - mean) * MASK) ** 2).sum() / (n - 1)
    close(mean, 0.0)
    close(var, 1.0, tol=1e-4)
    assert (adv[MASK == 0] == 0).all()


def test_gae_needs_values():
    with pytest.raises(ValueError, match="needs the critic's values"):
        gae(torch.ones(4), MASK)


def test_whiten_uses_only_masked_entries():
    out = whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]), eps=0.0)
    close(out, [-1.0, 0.0, 1.0, 0.0])
    out = whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]), shift_mean=False, eps=0.0)
    close(out, [1.0, 2.0, 3.0, 0.0])


def test_outcome_rewards_land_on_the_last_response_token():
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = outcome_to_token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    close(out, [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, -1]])


def test_compute_advantages_rejects_options_the_estimator_lacks():
    adv, _ = compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.ones(2, 2),
                                group_ids=torch.tensor([0, 0]), norm_by_std=False)
    close(adv[:, 0], [0.5, -0.5])
    with pytest.raises(ValueError, match="'grpo' has no option 'gamma'; its options are: norm_by_std, eps"):
        compute_advantages("grpo", torch.ones(2), torch.ones(2, 2), group_ids=torch.tensor([0, 0]), gamma=1.0)


def test_gae_scale_only_keeps_zero_advantages_at_zero():
    # lam = 1: advantages r - V, here [1, 0, -0.5, 0] on both tokens of each row; over the 8 tokens the
    # mean is 0.125 and the Bessel-corrected variance 2.375 / 7, so the std is 0.58248
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    values = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    adv, _ = gae(rewards, mask, values=values, lam=1.0, center=False)
    std = (2.375 / 7) ** 0.5
    close(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0], [-0.5, -0.5], [0.0, 0.0]]) / std)
    centered, _ = gae(rewards, mask, values=values, lam=1.0)
    close(centered[1], torch.full((2,), -0.125 / std))  # whitening moves the zero advantages too
