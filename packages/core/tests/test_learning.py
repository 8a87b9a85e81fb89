"""The built-in task learns: a short run of the default recipe, and of PPO with its defaults, lifts the reward
clearly above chance."""

import statistics

import pytest

from gearshift import Trainer


@pytest.mark.parametrize("algorithm,steps", [("grpo", 48), ("ppo", 40)])  # ppo: with its own defaults
def test_reward_rises_clearly_above_chance(tmp_path, monkeypatch, algorithm, steps):
    monkeypatch.setenv("GEARSHIFT_CACHE", str(tmp_path / "cache"))  # the warm-up model is built here
    history = Trainer(
        model="small-add", algorithm={"name": algorithm}, rollout={"backend": "hf"}, train={"backend": "torch"},
        run={"steps": steps, "output_dir": str(tmp_path / "run"), "checkpoint_every": 0, "progress": False,
             "samples_per_step": 0, "tensorboard": False, "plot": False, "resume": "never"},
    ).train()
    rewards = [h["reward/mean"] for h in history]
    start, end = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    print(f"{algorithm} reward: first 5 steps {start:.3f}, last 5 steps {end:.3f}")
    assert start < 0.25  # the warm-up teaches the answer format, not the answers: near chance (1 in 10)
    assert end > 0.3 and end > start + 0.15, rewards
