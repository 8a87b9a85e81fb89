"""Learned rewards: the locally built reward model, the scorer, weighing it with a rule, and GRPO/PPO runs with it."""

import pytest
import torch

from gearshift import Trainer
from gearshift.models import resolve_model
from gearshift.rl.config import ConfigError, load_config
from gearshift.rl.presets import task_examples
from gearshift.rl.reward_model import RewardModel, RewardModelError, combine
from gearshift.rl.warmup import TASK_MODEL_OPTIONS

FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


@pytest.fixture(scope="module")
def add_rm():
    return resolve_model("tiny-add-rm")


def test_the_task_trained_reward_model_agrees_with_the_rule(add_rm):
    rm = RewardModel(add_rm, device=torch.device("cpu"))
    examples = task_examples("add", 200, seed=1234, **TASK_MODEL_OPTIONS["add"])  # rows it was not trained on
    scores = rm.score([p for p, _, _ in examples], [c for _, c, _ in examples])
    rule = [r for _, _, r in examples]
    agree = sum((s > 0.5) == (r > 0.5) for s, r in zip(scores, rule)) / len(rule)
    assert 0.1 < sum(rule) / len(rule) < 0.9  # both kinds of completion are there
    assert agree >= 0.9, agree
    right = [s for s, r in zip(scores, rule) if r == 1]
    wrong = [s for s, r in zip(scores, rule) if r == 0]
    assert sum(right) / len(right) > sum(wrong) / len(wrong) + 0.5


def test_scores_do_not_depend_on_the_batching(add_rm):
    prompts, completions = ["3+1=", "7+1=", "2+1="] * 3, ["4", "1234567", "X"] * 3
    one = RewardModel(add_rm, device=torch.device("cpu"), batch_size=1).score(prompts, completions)
    many = RewardModel(add_rm, device=torch.device("cpu"), batch_size=4).score(prompts, completions)
    assert one == pytest.approx(many, abs=1e-5)
    assert one[0] > one[1]  # '3+1=4' is right, '7+1=1234567' is not


def test_chat_prompts_go_through_the_reward_models_template(add_rm):
    rm = RewardModel(add_rm, device=torch.device("cpu"))
    [text] = rm.texts([[{"role": "user", "content": "3+1="}]], ["4"])
    assert text == "<|im_start|>user\n3+1=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert rm.texts(["3+1="], ["4"]) == ["3+1=4"]


def test_a_causal_lm_is_not_a_reward_model(gearshift_model):
    with pytest.raises(RewardModelError, match="one"):
        RewardModel(gearshift_model, device=torch.device("cpu"))


def test_combine_weighs_and_keeps_drops():
    assert combine([1.0, None, 0.0], [0.5, 0.5, 2.0], [1.0, 0.5]) == [1.25, None, 1.0]
    assert combine(None, [0.5, 2.0], [1.0, 2.0]) == [1.0, 4.0]
    assert combine([1.0], None, [3.0, 1.0]) == [3.0]
    with pytest.raises(ValueError):
        combine([1.0], [1.0, 2.0], [1.0, 1.0])


def test_reward_config_keys_and_mistakes():
    cfg = load_config(None, ["reward.model=tiny-add-rm"])
    assert cfg.reward.rule(cfg.data) is None  # the model alone scores
    cfg = load_config(None, ["reward.model=tiny-add-rm", "reward.fn=gearshift.rewards:numeric_match"])
    assert cfg.reward.rule(cfg.data) == "gearshift.rewards:numeric_match"
    assert load_config(None, []).reward.rule(load_config(None, []).data)  # no model: the task's own reward
    with pytest.raises(ConfigError, match="reward.weights"):
        load_config(None, ["reward.model=x", "reward.weights=[1,2,3]"]).validate()
    load_config(None, ["data.path=rows.jsonl", "reward.model=x"]).validate()  # a model is a reward for a dataset
    with pytest.raises(ConfigError, match="reward.fn is not set"):
        load_config(None, ["data.path=rows.jsonl"]).validate()


def _trainer(model, tmp_path, **sections):
    return Trainer(model=model, data={"task": "add", "task_options": TASK_MODEL_OPTIONS["add"]},
                   rollout={"n": 4, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch"},
                   run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path), **FAST}, **sections)


def test_grpo_with_a_reward_model_weighed_with_the_rule(gearshift_model, add_rm, tmp_path):
    history = _trainer(gearshift_model, tmp_path, reward={"model": add_rm, "fn": "gearshift.rewards:numeric_match",
                                                          "weights": [1.0, 0.5]}).train()
    for m in history:
        assert m["time/reward_model"] > 0 and "train/pg_loss" in m
        assert m["reward/mean"] == pytest.approx(m["reward/fn_mean"] + 0.5 * m["reward/model_mean"], abs=1e-6)


def test_ppo_with_a_reward_model_alone(gearshift_model, add_rm, tmp_path):
    history = _trainer(gearshift_model, tmp_path, algorithm={"name": "ppo"},
                       reward={"model": add_rm}).train()
    for m in history:
        assert m["reward/mean"] == pytest.approx(m["reward/model_mean"], abs=1e-6)
        assert "reward/fn_mean" not in m and "train/critic/vf_loss" in m
