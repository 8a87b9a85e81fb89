import math

import pytest

from gearshift.rl.rewards import (
    Reward, RewardError, combine_rewards, exact_match, format_match, load_reward, numeric_match, strict_numeric_match,
)


def test_builtins_by_module_name():
    exact = load_reward("gearshift.rewards:exact_match")
    assert exact.fn is exact_match
    assert exact("  19\n", prompt="12+7=", answer="19") == 1.0
    assert exact("19 ", answer="190") == 0.0
    numeric = load_reward("gearshift.rewards:numeric_match")
    assert numeric("so 12+7 is 19.", prompt="12+7=", answer="19") == 1.0
    assert numeric("19 or 20", answer=19) == 0.0  # the last number counts by default


@pytest.mark.parametrize("completion, answer, which, expected", [
    ("x = -3", "-3", "last", 1.0),
    ("5-3 gives 2", 2, "last", 1.0),  # "-3" here is subtraction, not a negative number
    ("5-3 gives 2", 5, "first", 1.0),
    ("total 1,234.5 dollars", "1234.5", "last", 1.0),
    ("about 0.3334", 1 / 3, "last", 0.0),  # off by 7e-5, beyond the default tol
    ("no digits", "7", "last", 0.0),
])
def test_numeric_match(completion, answer, which, expected):
    assert numeric_match(completion, answer, which=which) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("9", "9", 1.0), (" 9\n", "9", 1.0), ("9.", "9", 1.0), ("9 !", "9", 1.0), ("-3", -3, 1.0),
    ("1,234.5", "1234.5", 1.0), ("9.5.", "9.5", 1.0),
    ("X9", "9", 0.0), ("9X", "9", 0.0), ("9 apples", "9", 0.0), ("it is 9", "9", 0.0), ("9..", "9", 0.0),
    ("9 9", "9", 0.0), ("(9)", "9", 0.0), ("", "9", 0.0), ("8", "9", 0.0),
])
def test_strict_numeric_match_takes_the_number_alone(completion, answer, expected):
    assert numeric_match(completion, answer, strict=True) == expected
    assert strict_numeric_match(completion, answer) == expected
    assert load_reward("gearshift.rewards:strict_numeric_match")(completion, answer=answer) == expected
    if expected:  # what the strict mode accepts, the lenient one does too
        assert numeric_match(completion, answer) == 1.0


def test_numeric_match_tolerance_as_an_option():
    assert load_reward("gearshift.rewards:numeric_match", tol=1e-3)("0.3334", answer=1 / 3) == 1.0
    with pytest.raises(RewardError, match="answer 'seven' is not a number"):
        load_reward("gearshift.rewards:numeric_match")("7", answer="seven")


def test_format_match():
    fmt = load_reward("gearshift.rewards:format_match", pattern=r"-?\d+")
    assert fmt(" 42 ", answer="1") == 1.0
    assert fmt("42 apples", answer="1") == 0.0
    assert format_match("<a>x</a>", pattern=r"<a>.*</a>") == 1.0


def test_file_reward_gets_the_columns_it_names(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(completion, answer, bonus=0.0):\n"
        "    return float(completion == answer) + bonus\n"
        "def drop(completion, **row):\n"
        "    return None if row['answer'] == 'skip' else len(row)\n"
        "LIMIT = 3\n"
    )
    score = load_reward(f"{tmp_path}/my_rewards.py:score")
    assert score("a", prompt="p", answer="a", extra_column=[1, 2]) == 1.0
    assert score("a", answer="a", bonus=0.5) == 1.5
    monkeypatch.chdir(tmp_path)
    drop = load_reward("my_rewards.py:drop")
    assert drop("x", answer="skip") is None
    assert drop("x", answer="y", prompt="p") == 2.0


def test_load_errors_name_the_problem(tmp_path):
    (tmp_path / "r.py").write_text("def ok(completion):\n    return 1.0\nLIMIT = 3\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardError, match="file .*missing.py not found"):
        load_reward(f"{tmp_path}/missing.py:ok")
    with pytest.raises(RewardError, match="has no function 'nope'; it offers: ok$"):
        load_reward(f"{tmp_path}/r.py:nope")
    # a module that re-exports its rewards (gearshift.rewards) lists what it exports
    with pytest.raises(RewardError, match="no function 'no_such_fn'; it offers: .*exact_match.*numeric_match"):
        load_reward("gearshift.rewards:no_such_fn")
    with pytest.raises(RewardError, match="LIMIT is a int, not a function"):
        load_reward(f"{tmp_path}/r.py:LIMIT")
    with pytest.raises(RewardError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_reward(f"{tmp_path}/broken.py:ok")
    with pytest.raises(RewardError, match="no module named 'no_such_pkg.rewards'"):
        load_reward("no_such_pkg.rewards:score")
    with pytest.raises(RewardError, match="must be 'module:function'"):
        load_reward("exact_match")
    with pytest.raises(RewardError, match="has no parameter tolerance; it takes answer, strict, tol, which"):
        load_reward("gearshift.rewards:numeric_match", tolerance=0.1)


def test_bad_return_values_name_the_reward_and_the_value():
    with pytest.raises(RewardError, match=r"reward 'words' returned 'yes' of type str for completion 'hi'"):
        Reward(lambda completion: "yes", name="words")("hi")
    with pytest.raises(RewardError, match="returned nan"):
        Reward(lambda completion: math.nan, name="n")("hi")
    assert Reward(lambda completion: True)("hi") == 1.0


def test_missing_column_and_raising_reward():
    reward = load_reward("gearshift.rewards:exact_match")
    with pytest.raises(RewardError, match="needs the column\\(s\\) answer; the dataset has prompt, solution"):
        reward.check_columns(["prompt", "solution"])
    with pytest.raises(RewardError, match="needs the column"):
        reward("x", prompt="p")

    def fails(completion):
        return 1 / 0

    with pytest.raises(RewardError, match="reward 'fails' raised ZeroDivisionError") as err:
        Reward(fails, name="fails")("x")
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_combined_rewards_are_a_weighted_sum_and_none_drops():
    combined = combine_rewards({"gearshift.rewards:exact_match": 1.0,
                                load_reward("gearshift.rewards:format_match", pattern=r"\d+"): 0.25})
    assert combined("19", answer="19") == 1.25
    assert combined("x19", answer="19") == 0.0
    assert combined("20", answer="19") == 0.25
    with pytest.raises(RewardError, match="needs the column"):
        combined.check_columns(["prompt"])
    dropping = load_reward({exact_match: 1.0, (lambda completion: None): 1.0})
    assert dropping("19", answer="19") is None
