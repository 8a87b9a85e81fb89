"""The README's multi-turn example, as a user copies it: its tool and its environment run in a training run."""

import json
import re
from pathlib import Path

import pytest

from gearshift import Trainer
from gearshift.rl.rewards import RewardError

README = Path(__file__).resolve().parents[1] / "README.md"
FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


def _readme_file(name: str) -> str:
    """The README's python block that begins `# <name>`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if b.startswith(f"# {name}\n")]
    assert len(found) == 1, f"the README has {len(found)} python blocks beginning '# {name}'"
    return found[0]


@pytest.fixture
def readme_files(tmp_path):
    for name in ("my_tools.py", "my_envs.py"):
        (tmp_path / name).write_text(_readme_file(name))
    rows = [{"prompt": f"guess {i % 3}:", "answer": str(i % 10)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_the_readme_environment_gives_a_reward_on_every_turn(readme_files, monkeypatch):
    """The turn and token limits can end an episode after any turn, so a turn that gives no reward leaves an
    episode with nothing to score it (the README's run has no reward.fn)."""
    monkeypatch.syspath_prepend(str(readme_files))
    from my_envs import Guess

    env = Guess()
    env.reset({"prompt": "guess:", "answer": "7"})
    for text in ["", "abc", " 3", "9", "7"]:
        observation, done, reward = env.step(text)
        assert isinstance(observation, str) and isinstance(reward, float), (text, reward)
    assert done and reward == 1.0


def test_the_readme_tool_and_environment_train_as_written(readme_files, gearshift_model):
    run = readme_files / "run"
    history = Trainer(
        model=gearshift_model, dataset=str(readme_files / "train.jsonl"),
        agent={"tools": [f"{readme_files}/my_tools.py:lookup"], "environment": f"{readme_files}/my_envs.py:Guess",
               "max_turns": 3, "max_tokens": 24},
        rollout={"backend": "hf", "n": 2, "max_tokens": 3}, train={"backend": "torch"},
        run={"steps": 2, "prompts_per_step": 4, "output_dir": str(run), **FAST}).train()
    assert len(history) == 2 and all(m["agent/turns_mean"] >= 1 for m in history)
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in history)


def test_an_episode_nobody_scores_stops_the_run_naming_the_row_and_the_fix(readme_files, gearshift_model):
    (readme_files / "silent.py").write_text(
        "from gearshift.rl.agent import Environment\n\n"
        "class Silent(Environment):\n"
        "    def reset(self, row):\n        pass\n\n"
        "    def step(self, text):\n        return ' go on ', False, None\n")
    with pytest.raises(RewardError, match=r"train\.jsonl:\d+: its episode's environment gave no reward.*reward\.fn"):
        Trainer(model=gearshift_model, dataset=str(readme_files / "train.jsonl"),
                agent={"environment": f"{readme_files}/silent.py:Silent", "max_turns": 2, "max_tokens": 16},
                rollout={"backend": "hf", "n": 2, "max_tokens": 3}, train={"backend": "torch"},
                run={"steps": 1, "prompts_per_step": 2, "output_dir": str(readme_files / "run2"), **FAST}).train()
