"""A batch that trains once, in one mini-batch, takes its old logprobs from the training forward: no separate
pass, the same update, the same mismatch figures; anything that needs them before the update keeps the pass."""

import pytest
import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.rl.config import build_config
from gearshift.rl.learner import Learner
from gearshift.rollout import Rollout


def _rollouts():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(2):
        for j in range(4):
            tokens = torch.randint(32, 120, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            logprobs = (-torch.rand(len(tokens), generator=g) * 3).tolist()
            out.append(Rollout([40 + i, 43, 49, 61], tokens, logprobs, "length", prompt_index=i, sample_index=j))
    return out, [float(k % 2) for k in range(8)]


def _learn(model, train=None, **algorithm):
    cfg = build_config(None, {"algorithm": algorithm, "run": {"prompts_per_step": 2},
                              "rollout": {"n": 4, "logprobs": "always"},
                              "train": train or {}})
    engine = TorchTrainEngine.build(model, lr=1e-2)
    calls = []
    forward = engine.forward_logprobs
    engine.forward_logprobs = lambda *a, **k: calls.append(1) or forward(*a, **k)
    learner = Learner(cfg, engine)
    kept, rewards = _rollouts()
    metrics = learner.learn(kept, rewards, 0, timed=lambda name: __import__("contextlib").nullcontext())
    return engine, metrics, len(calls), learner


def test_one_pass_over_the_batch_takes_its_old_logprobs_from_the_training_forward(gearshift_model):
    reused, m_reused, passes_reused, learner = _learn(gearshift_model, entropy_coef=0.01)
    kept, m_kept, passes_kept, _ = _learn(gearshift_model, entropy_coef=0.01, old_logprobs="recompute")
    assert learner.reuses_old_logprobs() and (passes_reused, passes_kept) == (0, 1)
    a, b = dict(reused.model.named_parameters()), dict(kept.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a), "the update must be the one a separate pass gives"
    for key in ("mismatch/logprob_mean", "mismatch/logprob_max", "train/loss", "train/entropy"):
        assert m_reused[key] == pytest.approx(m_kept[key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("algorithm", [{"epochs": 2}, {"rollout_correction": "tis"},
                                       {"train": {"mini_batch_size": 4}}, {"kl_coef": 0.1, "kl_in": "reward",
                                                                          "advantage": "reinforce"}])
def test_the_separate_pass_runs_when_something_needs_the_logprobs_before_the_update(gearshift_model, algorithm):
    _, _, passes, learner = _learn(gearshift_model, **algorithm)
    assert not learner.reuses_old_logprobs() and passes >= 1


def test_with_several_mini_batches_the_first_takes_its_old_logprobs_from_its_training_forward(gearshift_model):
    """The first mini-batch trains before any update: its forward's logprobs are the old ones. The separate pass
    runs over the other rows only, and the update and the figures are those of a pass over every row."""
    rows = []
    engine = TorchTrainEngine.build(gearshift_model, lr=1e-2)
    forward = engine.forward_logprobs
    engine.forward_logprobs = lambda batch, **k: rows.append(batch.size) or forward(batch, **k)
    cfg = build_config(None, {"algorithm": {"entropy_coef": 0.01}, "run": {"prompts_per_step": 2},
                              "rollout": {"n": 4, "logprobs": "always"}, "train": {"mini_batch_size": 4}})
    kept, rewards = _rollouts()
    m_first = Learner(cfg, engine).learn(kept, rewards, 0, timed=lambda name: __import__("contextlib").nullcontext())
    full, m_full, passes, _ = _learn(gearshift_model, train={"mini_batch_size": 4}, entropy_coef=0.01,
                                     old_logprobs="recompute")
    assert rows == [4] and passes == 1, "the pass runs over the second mini-batch's four rows alone"
    a, b = dict(engine.model.named_parameters()), dict(full.model.named_parameters())
    assert all(torch.allclose(a[n], b[n], rtol=0, atol=1e-6) for n in a), "the same update as a pass over all rows"
    for key in ("mismatch/logprob_mean", "mismatch/logprob_max", "train/loss", "train/entropy"):
        assert m_first[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-6), key


def test_ppo_two_mini_batches_keep_half_the_pass(gearshift_model):
    _, _, passes, learner = _learn(gearshift_model, name="ppo", advantage="grpo")
    assert learner._reusable() and not learner.reuses_old_logprobs() and passes == 1
