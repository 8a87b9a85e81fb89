"""Training on episodes: only the model's own tokens carry loss, KL and entropy, or weigh in advantage statistics."""

import contextlib
import copy

import pytest
import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.rl.agent import Agent, AgentConfig
from gearshift.rl.agent.builtin import GuessNumber
from gearshift.rl.algos import compute_advantages, make_policy_loss_fn
from gearshift.rl.config import build_config
from gearshift.rl.learner import Learner, episode_loss_mask
from gearshift.rollout import Rollout, SamplingParams
from gearshift.train import PolicyOutput, TrainBatch

NO_TIMER = contextlib.nullcontext


@pytest.fixture(scope="module")
def episodes(gearshift_model):
    """Multi-turn episodes sampled by the hf engine: 2 prompts x 4 samples of number guessing."""
    from transformers import AutoTokenizer

    from gearshift.backends.hf_rollout import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(gearshift_model)
    engine = HFRolloutEngine.build(gearshift_model)
    agent = Agent(AgentConfig(environment=GuessNumber, max_turns=3, max_tokens=24), tok,
                  max_model_len=engine.max_model_len)
    rows = [{"prompt": "guess 0-9:", "answer": "3"}, {"prompt": "guess 0-9:", "answer": "8"}]
    out = agent.run(engine.generate, rows, [tok(r["prompt"])["input_ids"] for r in rows],
                    SamplingParams(n=4, max_tokens=3, seed=1))
    assert sum(x.extra["loss_mask"].count(0) for x in out) > 0, "the episodes must hold environment tokens"
    return out


def _rewards(episodes):
    return [float(i % 3 == 0) for i in range(len(episodes))]


def _learn(model, kept, rewards, ref_logprobs=None, **algorithm):
    cfg = build_config(None, {"algorithm": algorithm, "run": {"prompts_per_step": 2},
                              "rollout": {"n": 4, "logprobs": "always"}})
    torch.manual_seed(0)
    policy = TorchTrainEngine.build(model, lr=1e-2)
    critic = TorchTrainEngine.build(model, lr=1e-2, value_head=True) if algorithm.get("name") == "ppo" else None
    reference = TorchTrainEngine.build(model) if algorithm.get("kl_coef") and ref_logprobs is None else None
    seen = []
    step = policy.train_step
    policy.train_step = lambda batch, loss: seen.append(batch) or step(batch, loss)
    metrics = Learner(cfg, policy, reference, critic).learn(kept, rewards, 0, NO_TIMER, ref_logprobs=ref_logprobs)
    return policy, metrics, seen


def _tool_positions(kept, like):
    """[B, T] 1 where a sequence holds an environment token."""
    out = torch.zeros_like(like)
    for i, x in enumerate(kept):
        for j, m in enumerate(x.extra["loss_mask"]):
            out[i, len(x.prompt_ids) + j] = 1 - m
    return out


@pytest.mark.parametrize("algorithm", [{"name": "grpo", "kl_coef": 0.1, "entropy_coef": 0.01},
                                       {"name": "ppo", "kl_coef": 0.1, "entropy_coef": 0.01}])
def test_the_trained_batch_masks_environment_tokens_out(gearshift_model, episodes, algorithm):
    _, metrics, seen = _learn(gearshift_model, episodes, _rewards(episodes), **algorithm)
    start = 0
    assert seen
    for batch in seen:  # mini-batches: consecutive slices of the step's batch, in order
        rows = episodes[start:start + batch.size]
        start = (start + batch.size) % len(episodes)
        plain = TrainBatch.from_sequences([x.prompt_ids for x in rows], [x.token_ids for x in rows]).loss_mask
        plain = plain[:, :batch.width]
        tool = _tool_positions(rows, torch.zeros(plain.shape[0], max(plain.shape[1], batch.width)))[:, :batch.width]
        assert (batch.loss_mask * tool).sum() == 0  # no loss, KL or entropy on them
        assert (batch.extras["advantages"] * tool).abs().sum() == 0
        assert torch.equal(batch.loss_mask + tool, plain)  # every model token still trains
    # the environment's tokens have rollout logprobs 0, far from the trainer's: they would show here
    assert metrics["mismatch/logprob_max"] < 1e-4


def test_the_update_ignores_what_lies_under_environment_tokens(gearshift_model, episodes):
    """Rollout logprobs and reference logprobs at environment tokens (0 and arbitrary) change nothing: not the
    rollout correction, not the KL in the loss."""
    ref = [[-1.0] * len(x.token_ids) for x in episodes]

    def scrambled():
        out = copy.deepcopy(episodes)
        refs = copy.deepcopy(ref)
        for x, r in zip(out, refs):
            for j, m in enumerate(x.extra["loss_mask"]):
                if not m:
                    x.logprobs[j], r[j] = -7.0, 5.0
        return out, refs

    options = dict(name="grpo", kl_coef=0.5, rollout_correction="tis", old_logprobs="recompute")
    a, ma, _ = _learn(gearshift_model, episodes, _rewards(episodes), ref_logprobs=ref, **options)
    kept, refs = scrambled()
    b, mb, _ = _learn(gearshift_model, kept, _rewards(episodes), ref_logprobs=refs, **options)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    for key in ("kl/ref", "mismatch/logprob_max", "train/loss"):
        assert ma[key] == mb[key], key
    # and the check can fail: without the episodes' masks the same change moves the update
    for x in kept:
        x.extra["loss_mask"] = [1] * len(x.token_ids)
    c, _, _ = _learn(gearshift_model, kept, _rewards(episodes), ref_logprobs=refs, **options)
    pc = dict(c.model.named_parameters())
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)


def test_no_gradient_reaches_environment_tokens_through_loss_kl_or_entropy():
    g = torch.Generator().manual_seed(0)
    prompts, responses = [[1, 2], [3]], [[4, 5, 6, 7], [8, 9, 10]]
    rollouts = [Rollout(p, r, [0.0] * len(r), "stop", extra={"loss_mask": m})
                for p, r, m in zip(prompts, responses, [[1, 0, 0, 1], [1, 1, 0]])]
    batch = TrainBatch.from_sequences(prompts, responses)
    batch.loss_mask = episode_loss_mask(rollouts, batch.loss_mask)
    shape = batch.loss_mask.shape
    batch.extras.update(advantages=torch.randn(shape, generator=g), old_logprobs=-torch.rand(shape, generator=g),
                        ref_logprobs=-torch.rand(shape, generator=g))
    logp = (-torch.rand(shape, generator=g)).requires_grad_()
    entropy = torch.rand(shape, generator=g).requires_grad_()
    loss, _ = make_policy_loss_fn("ppo_clip", kl_coef=0.3, entropy_coef=0.2)(PolicyOutput(logp, entropy), batch)
    loss.backward()
    tool = _tool_positions(rollouts, batch.loss_mask).bool()
    assert tool.sum() == 3
    assert (logp.grad[tool] == 0).all() and (entropy.grad[tool] == 0).all()
    assert (logp.grad[batch.loss_mask.bool()] != 0).all() and (entropy.grad[batch.loss_mask.bool()] != 0).all()


def test_advantage_whitening_counts_only_the_models_tokens():
    prompts, responses = [[1], [2]], [[4, 5, 6, 7], [8, 9, 10]]
    rollouts = [Rollout(p, r, [0.0] * len(r), "stop", extra={"loss_mask": m})
                for p, r, m in zip(prompts, responses, [[1, 0, 0, 1], [1, 1, 0]])]
    batch = TrainBatch.from_sequences(prompts, responses)
    mask = episode_loss_mask(rollouts, batch.loss_mask)
    tool = _tool_positions(rollouts, mask)
    values = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
    rewards = torch.tensor([1.0, 0.0])
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=1.0, lam=0.9)
    adv2, ret2 = compute_advantages("gae", rewards, mask, values=values + 100 * tool, gamma=1.0, lam=0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2) and (adv * tool).abs().sum() == 0
    leaky, _ = compute_advantages("gae", rewards, batch.loss_mask, values=values + 100 * tool, gamma=1.0, lam=0.9)
    assert not torch.allclose(leaky * mask, adv)


def test_a_loss_mask_that_does_not_fit_its_episode_is_an_error():
    x = Rollout([1], [2, 3], [0.0, 0.0], "stop", extra={"loss_mask": [1]})
    with pytest.raises(ValueError, match="1 entries for its 2 tokens"):
        episode_loss_mask([x], TrainBatch.from_sequences([[1]], [[2, 3]]).loss_mask)


FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


@pytest.mark.parametrize("task,algorithm,lora", [("calc", "ppo", 0), ("guess", "grpo", 4)])
def test_a_run_trains_on_episodes_and_reports_them(gearshift_model, tmp_path, task, algorithm, lora):
    from gearshift import Trainer

    if lora:
        pytest.importorskip("peft")
    model = {"path": gearshift_model, "lora": {"r": lora}} if lora else gearshift_model
    history = Trainer(model=model, data={"task": task}, algorithm={"name": algorithm},
                      agent={"max_turns": 3, "max_tokens": 24}, rollout={"n": 2, "max_tokens": 8, "backend": "hf",
                                                                 "logprobs": "always"},
                      train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 2, "output_dir": str(tmp_path), **FAST}).train()
    last = history[-1]
    for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/tool_errors_mean", "agent/episode_len_mean",
                "agent/model_token_share"):
        assert key in last, key
    assert 1 <= last["agent/turns_mean"] <= 3 and 0 < last["agent/model_token_share"] <= 1
    assert last["mismatch/logprob_max"] < 1e-4

