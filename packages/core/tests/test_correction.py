"""Rollout correction (tis / mis at token, sequence and geometric level) against values worked out by hand."""

import math

import pytest
import torch

from gearshift.rl.algos import ROLLOUT_WEIGHTS, make_policy_loss_fn, rollout_correction
from gearshift.train import PolicyOutput, TrainBatch

# two sequences, the second one token shorter; ratios pi_old / pi_rollout of each response token:
#   sequence 0: 0.5/0.2 = 2.5, 0.2/0.5 = 0.4, 0.5/0.5 = 1.0   product 1.0, geometric mean 1.0
#   sequence 1: 0.6/0.5 = 1.2, 0.3/0.1 = 3.0, (padding)       product 3.6, geometric mean sqrt(3.6) = 1.897
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.5], [0.6, 0.3, 0.9]]))
ROLLOUT = torch.log(torch.tensor([[0.2, 0.5, 0.5], [0.5, 0.1, 0.1]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_token_tis_caps_each_ratio():
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="token", cap=2.0)
    close(weights, [[2.0, 0.4, 1.0], [1.2, 2.0, 0.0]])
    close(m["ratio_mean"], (2.5 + 0.4 + 1.0 + 1.2 + 3.0) / 5)
    close(m["ratio_max"], 3.0)
    close(m["ratio_min"], 0.4)
    close(m["truncated_frac"], 2 / 5)  # 2.5 and 3.0
    close(m["weight_mean"], (2.0 + 0.4 + 1.0 + 1.2 + 2.0) / 5)
    assert m["masked_frac"] == 0.0


def test_token_mis_drops_ratios_outside_the_interval():
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level="token", cap=2.0)
    close(weights, [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # 2.5 > 2, 0.4 < 1/2, 3.0 > 2 dropped
    close(m["masked_frac"], 3 / 5)
    close(m["weight_mean"], 2 / 5)
    # a wider interval, [1/3.5, 3.5], keeps every one
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level="token", cap=3.5)
    close(weights, MASK)
    assert m["masked_frac"] == 0.0


def test_sequence_level_uses_the_product_of_the_ratios():
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="sequence", cap=2.0)
    close(weights, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])  # 2.5 * 0.4 * 1 = 1; 1.2 * 3 = 3.6 capped to 2
    close(m["ratio_mean"], (1.0 + 3.6) / 2)  # over sequences
    close(m["ratio_max"], 3.6)
    close(m["ratio_min"], 1.0)
    close(m["truncated_frac"], 2 / 5)  # the tokens of sequence 1
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level="sequence", cap=2.0)
    close(weights, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(m["masked_frac"], 2 / 5)


def test_geometric_level_uses_the_mean_log_ratio():
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="geometric", cap=2.0)
    g = math.sqrt(3.6)  # 1.897: under the cap, where the product (3.6) is over it
    close(weights, [[1.0, 1.0, 1.0], [g, g, 0.0]])
    close(m["ratio_max"], g)
    assert m["truncated_frac"] == 0.0
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level="geometric", cap=2.0)
    close(weights, MASK)
    assert m["masked_frac"] == 0.0


def test_none_measures_without_weighting_and_equal_logprobs_give_weight_one():
    weights, m = rollout_correction(OLD, ROLLOUT, MASK, mode="none")
    assert weights is None
    close(m["ratio_max"], 3.0)
    for mode in ("tis", "mis"):
        weights, m = rollout_correction(OLD, OLD.clone(), MASK, mode=mode, level="sequence")
        close(weights, MASK)
        assert m["ratio_mean"] == pytest.approx(1.0) and m["masked_frac"] == 0.0 and m["truncated_frac"] == 0.0


def test_bad_settings_name_the_choices():
    with pytest.raises(ValueError, match="use one of none, tis, mis"):
        rollout_correction(OLD, ROLLOUT, MASK, mode="is")
    with pytest.raises(ValueError, match="use one of token, sequence, geometric"):
        rollout_correction(OLD, ROLLOUT, MASK, level="seq")
    with pytest.raises(ValueError, match="must be >= 1"):
        rollout_correction(OLD, ROLLOUT, MASK, cap=0.5)


def test_policy_loss_weights_each_tokens_term():
    # on-policy (old = current), so each token's ppo_clip loss is -A; the weights multiply it, the
    # token mean still divides by all 5 response tokens
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, 1.0, 0.0]])
    weights, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)  # [[2, .4, 1], [1.2, 2, 0]]
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -0.7]], requires_grad=True)
    batch = TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), MASK,
                       {"advantages": adv, "old_logprobs": logp.detach().clone(), ROLLOUT_WEIGHTS: weights})
    loss, metrics = make_policy_loss_fn("ppo_clip")(PolicyOutput(logp), batch)
    expected = -(1.0 * 2.0 - 1.0 * 0.4 + 2.0 * 1.0 + 0.5 * 1.2 + 1.0 * 2.0) / 5  # -6.2 / 5
    close(loss, expected)
    close(metrics["pg_loss"], expected)
    loss.backward()
    close(logp.grad, -adv * weights / 5)
    assert weights.grad is None and not weights.requires_grad


def test_a_bf16_rollout_beside_fp32_training_is_measured_and_corrected(gearshift_model, tmp_path):
    from gearshift import Trainer

    def longer_is_better(completion):
        return len(completion) / 3

    history = Trainer(model=gearshift_model, reward=longer_is_better,
                      algorithm={"rollout_correction": "mis", "rollout_correction_cap": 1.001},
                      rollout={"backend": "hf", "dtype": "bfloat16", "n": 2, "max_tokens": 3},
                      train={"backend": "torch"},
                      run={"steps": 1, "prompts_per_step": 4, "output_dir": str(tmp_path), "checkpoint_every": 0,
                           "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
                           "resume": "never"}).train()
    step = history[0]
    assert "switch/share" not in step  # bf16 beside fp32: the rollout engine holds its own copy
    assert step["mismatch/logprob_max"] > 1e-4  # fp32 on both sides agrees to ~1e-6
    assert step["rollout_correction/ratio_max"] > 1.0 or step["rollout_correction/ratio_min"] < 1.0
    assert 0 < step["rollout_correction/masked_frac"] <= 1
