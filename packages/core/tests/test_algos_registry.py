import pytest

from gearshift.rl.algos import ADVANTAGES, Registry, get_advantage, get_policy_loss, grpo, ppo_clip, register_advantage


def test_builtins_are_registered_under_their_names():
    assert get_advantage("grpo") is grpo
    assert get_policy_loss("ppo_clip") is ppo_clip
    assert {"grpo", "rloo", "reinforce", "gae"} <= set(ADVANTAGES.names())


def test_typo_lists_known_names_and_suggests_the_closest():
    with pytest.raises(ValueError) as err:
        get_advantage("grop")
    msg = str(err.value)
    assert "did you mean 'grpo'" in msg
    assert "gae, grpo, reinforce, rloo" in msg
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*ppo_clip"):
        get_policy_loss("ppo")


def test_user_estimator_registers_and_lists_its_options():
    @register_advantage("test_constant")
    def constant(rewards, mask, *, group_ids=None, values=None, level: float = 1.0):
        return mask * level, mask * level

    try:
        assert get_advantage("test_constant") is constant
        assert ADVANTAGES.options("test_constant") == ["level"]
        ADVANTAGES.check_options("test_constant", {"level": 2.0})
        with pytest.raises(ValueError, match="has no option 'levle'; its options are: level"):
            ADVANTAGES.check_options("test_constant", {"levle": 2.0})
    finally:
        ADVANTAGES._fns.pop("test_constant")


def test_registration_checks_the_signature_and_name_clashes():
    reg = Registry("thing", data=("x", "mask"))

    @reg.register("a")
    def a(x, mask):
        return x

    with pytest.raises(TypeError, match="must accept x, mask; it lacks mask"):
        reg.register("b")(lambda x: x)

    def other(x, mask):
        return x

    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a")(other)
    reg.register("a")(a)  # the same function again (a module re-imported) is fine
    assert reg.names() == ["a"]
    assert reg.options("a") == []
    with pytest.raises(ValueError, match="its options are: none"):
        reg.check_options("a", {"gamma": 1.0})
