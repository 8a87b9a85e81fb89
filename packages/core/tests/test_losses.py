import math

import pytest
import torch

from gearshift.rl.algos import (
    aggregate, kl_in_reward, kl_k1, kl_k2, kl_k3, make_policy_loss_fn, make_value_loss_fn, ppo_clip, tokens_per_seq,
    value_loss,
)
from gearshift.rl.algos.losses import reinforce
from gearshift.train import PolicyOutput, TrainBatch


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_kl_estimators_match_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    x = math.log(2)
    close(kl_k1(logp, ref), [x])
    close(kl_k2(logp, ref), [0.5 * x * x])
    close(kl_k3(logp, ref), [0.5 - 1 + x])  # exp(ref - logp) - (ref - logp) - 1


def test_k1_and_k3_are_unbiased_for_kl_policy_to_reference():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = (p * (p / q).log()).sum()
    for estimator in (kl_k1, kl_k3):
        close((p * estimator(p.log(), q.log())).sum(), exact)
    assert (kl_k3(p.log(), q.log()) >= 0).all()


def test_ppo_clip_four_quadrants():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    losses, m = ppo_clip(logp, old, adv, torch.ones(4), clip_low=0.2)
    # max(-A r, -A clip(r)): clipped when it is the larger (more pessimistic) term
    close(losses, [-1.2, -0.5, 1.5, 0.8])
    close(m["clip_frac"], 0.5)
    close(m["approx_kl"], ((torch.tensor([1.5, 0.5, 1.5, 0.5]) - 1) - logp).mean())


def test_ppo_clip_asymmetric_and_dual_clip():
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.7, 5.0]))
    adv = torch.tensor([1.0, -1.0, -1.0])
    losses, _ = ppo_clip(logp, old, adv, torch.ones(3), clip_low=0.2, clip_high=0.28)
    close(losses, [-1.28, 0.8, 5.0])
    losses, m = ppo_clip(logp, old, adv, torch.ones(3), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    close(losses, [-1.28, 0.8, 3.0])
    close(m["dual_clip_frac"], 1 / 3)
    with pytest.raises(ValueError, match="dual_clip=1.0 must be > 1"):
        ppo_clip(logp, old, adv, torch.ones(3), dual_clip=1.0)


def test_on_policy_ppo_gradient_is_the_policy_gradient_and_clipped_tokens_get_none():
    adv = torch.tensor([2.0, -1.0, 0.5])
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ppo_clip(logp, logp.detach(), adv, torch.ones(3))[0].sum().backward()
    close(logp.grad, -adv)
    logp2 = logp.detach().clone().requires_grad_()
    reinforce(logp2, None, adv, torch.ones(3))[0].sum().backward()
    close(logp2.grad, -adv)
    clipped = torch.tensor([math.log(2.0)], requires_grad=True)
    ppo_clip(clipped, torch.zeros(1), torch.ones(1), torch.ones(1))[0].sum().backward()
    close(clipped.grad, [0.0])


def test_aggregation_modes():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(aggregate(losses, mask, "token_mean"), 10 / 4)
    close(aggregate(losses, mask, "seq_mean_token_sum"), (6 + 4) / 2)
    close(aggregate(losses, mask, "seq_mean_token_mean"), (2 + 4) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'; use one of token_mean"):
        aggregate(losses, mask, "mean")


def test_tokens_per_seq_makes_micro_batched_token_mean_exact():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 0, 0, 0], [1.0, 1.0, 0, 0], [16.0, 0, 0, 0]])
    mask = (losses != 0).float()
    full = aggregate(losses, mask, "token_mean")
    norm = tokens_per_seq(mask)
    # weigh each micro-batch by its share of sequences, as TrainEngine.train_step does
    exact = sum(aggregate(losses[i:i + 2], mask[i:i + 2], "token_mean", norm[i:i + 2]) * 2 / 4 for i in (0, 2))
    naive = sum(aggregate(losses[i:i + 2], mask[i:i + 2], "token_mean") * 2 / 4 for i in (0, 2))
    close(exact, full)
    assert abs(float(naive - full)) > 0.1


def test_value_loss_is_clipped_around_the_old_value():
    values = torch.tensor([1.5, 0.9])
    old = torch.tensor([1.0, 1.0])
    returns = torch.tensor([2.0, 1.0])
    loss, m = value_loss(values, old, returns, torch.ones(2), clip=0.2)
    # token 0: max((1.5-2)^2, (1.2-2)^2) = .64; token 1: within the clip, (0.9-1)^2 = .01
    close(loss, (0.5 * 0.64 + 0.5 * 0.01) / 2)
    close(m["vf_clip_frac"], 0.5)
    loss, _ = value_loss(values, old, returns, torch.ones(2), clip=None)
    close(loss, (0.5 * 0.25 + 0.5 * 0.01) / 2)


def test_kl_in_reward_puts_outcome_on_the_last_token_and_kl_on_all():
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1]])
    logp = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -1.0], [0, -1.0, -3.0, -1.0]])
    rewards, kl = kl_in_reward(torch.tensor([1.0, 2.0]), mask, logp, ref, kl_coef=0.1, estimator="k1")
    close(kl, [[0, 0.5, -1.0, 0], [0, 0, 2.0, 0]])
    close(rewards, [[0, -0.05, 1.1, 0], [0, 0, -0.2, 2.0]])


def _batch(**extras):
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0]])
    return TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), mask, extras)


def test_policy_loss_fn_combines_pg_kl_and_entropy():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0, -0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0, -1.0], [0, -2.5, -7.0]])
    entropy = torch.tensor([[0.0, 1.0, 2.0], [5.0, 3.0, 5.0]])
    batch = _batch(advantages=torch.tensor([[0.0, 1, 1], [0, -3, 0]]), old_logprobs=logp.detach(), ref_logprobs=ref)
    fn = make_policy_loss_fn("ppo_clip", clip_low=0.2, kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss, metrics = fn(PolicyOutput(logp, entropy=entropy), batch)
    pg = (-1 - 1 + 3) / 3  # ratio 1: -A on each of the 3 response tokens
    kl = (0 - 1 + 2) / 3  # k1 = logp - ref
    ent = (1 + 2 + 3) / 3
    close(loss, pg + 0.5 * kl - 0.1 * ent)
    assert metrics["pg_loss"] == pytest.approx(pg, abs=1e-6) and metrics["kl"] == pytest.approx(kl, abs=1e-6)
    assert metrics["entropy"] == pytest.approx(ent) and metrics["clip_frac"] == 0.0
    loss.backward()
    close(logp.grad, [[0, (-1 + 0.5) / 3, (-1 + 0.5) / 3], [0, (3 + 0.5) / 3, 0]])


def test_policy_loss_fn_kl_in_reward_only_reports_it():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0, -0.5, -3.0]])
    batch = _batch(advantages=torch.ones(2, 3), ref_logprobs=torch.zeros(2, 3))
    loss, metrics = make_policy_loss_fn("reinforce", kl_coef=0.5, kl_in_loss=False, kl_estimator="k1")(
        PolicyOutput(logp), batch)
    close(loss, (1 + 2 + 0.5) / 3)
    assert metrics["kl"] == pytest.approx(-(1 + 2 + 0.5) / 3)


def test_policy_loss_fn_errors_say_what_to_change():
    with pytest.raises(ValueError, match="no option 'clip'; its options are: clip_low, clip_high, dual_clip"):
        make_policy_loss_fn("ppo_clip", clip=0.2)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        make_policy_loss_fn(kl_estimator="k4")
    logp = torch.zeros(2, 3)
    with pytest.raises(KeyError, match="no 'advantages'"):
        make_policy_loss_fn()(PolicyOutput(logp), _batch())
    with pytest.raises(KeyError, match="no 'ref_logprobs'"):
        make_policy_loss_fn(kl_coef=0.1)(PolicyOutput(logp), _batch(advantages=torch.ones(2, 3)))
    with pytest.raises(ValueError, match="returned no entropy"):
        make_policy_loss_fn(entropy_coef=0.1)(PolicyOutput(logp), _batch(advantages=torch.ones(2, 3)))
    with pytest.raises(ValueError, match=r"has shape \(2,\), expected \(2, 3\)"):
        make_policy_loss_fn()(PolicyOutput(logp), _batch(advantages=torch.ones(2)))


def test_value_loss_fn_reads_values_old_values_and_returns():
    values = torch.tensor([[0.0, 1.5, 0.9], [0, 1.0, 7.0]], requires_grad=True)
    batch = _batch(old_values=torch.tensor([[0.0, 1.0, 1.0], [0, 1.0, 0]]),
                   returns=torch.tensor([[0.0, 2.0, 1.0], [0, 0.0, 0]]))
    loss, metrics = make_value_loss_fn(clip=0.2)(PolicyOutput(torch.zeros(2, 3), values=values), batch)
    close(loss, (0.32 + 0.005 + 0.5) / 3)
    assert metrics["vf_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no values"):
        make_value_loss_fn()(PolicyOutput(torch.zeros(2, 3)), batch)


def test_policy_loss_fn_plugs_into_train_step_and_raises_rewarded_tokens(tmp_path):
    from gearshift.backends.torch_train import TorchTrainEngine
    from gearshift.models.tiny import build_model

    engine = TorchTrainEngine.build(build_model(tmp_path / "tiny", preset="tiny"), lr=1e-2, micro_batch_size=1)
    batch = TrainBatch.from_sequences([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    batch.extras["advantages"] = batch.loss_mask * torch.tensor([[1.0], [-1.0]])
    batch.extras["old_logprobs"] = before = engine.forward_logprobs(batch).logprobs
    batch.extras["tokens_per_seq"] = tokens_per_seq(batch.loss_mask)
    metrics = engine.train_step(batch, make_policy_loss_fn("ppo_clip"))
    # ratio 1: the token mean of -A over 5 tokens (2 with A=1, 3 with A=-1), exact over 2 micro-batches
    assert metrics["loss"] == pytest.approx(0.2, abs=1e-5) and metrics["clip_frac"] == 0.0
    after = engine.forward_logprobs(batch).logprobs
    gain = ((after - before) * batch.loss_mask).sum(-1)
    assert gain[0] > 0 > gain[1]
