import pytest

from gearshift.rl.config import Config, ConfigError, load_config, parse_overrides


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["a.b=1", "c=x", "d.e=[1, 2]", "f=true"]) == {"a": {"b": 1}, "c": "x", "d": {"e": [1, 2]}, "f": True}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["nonsense"])


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algorithm:\n  name: ppo\nrollout:\n  n: 4\n  options: {max_batch_size: 8}\n")
    cfg = load_config(f, ["rollout.n=6", "train.lr=1e-3", "rollout.options.seed=1"])
    assert cfg.algorithm.name == "ppo" and cfg.rollout.n == 6 and cfg.train.lr == 1e-3
    assert cfg.rollout.options == {"max_batch_size": 8, "seed": 1}
    assert isinstance(cfg.train.lr, float)


def test_unknown_keys_and_wrong_types_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lrr'\] in train"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="rollout.n='many': expected int"):
        load_config(None, ["rollout.n=many"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")


def test_validation_lists_what_to_change():
    cfg = load_config(None, ["run.prompts_per_step=3", "rollout.n=4", "train.mini_batch_size=5",
                             "train.mesh=dp=4", "algorithm.name=grpo"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=2)
    text = str(err.value)
    assert "mini_batch_size=5 does not divide the batch" in text
    assert "must be a multiple of rollout.n=4" in text
    assert "prompts_per_step=3 must divide evenly over 2 ranks" in text
    assert "train.mesh" in text and "world has 2" in text


def test_grpo_needs_groups_and_kl_in_reward_needs_token_rewards():
    with pytest.raises(ConfigError, match="n >= 2"):
        load_config(None, ["rollout.n=1"]).validate()
    with pytest.raises(ConfigError, match="kl_in=reward"):
        load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0.1"]).validate()
    Config().validate()
