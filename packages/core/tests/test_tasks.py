import json
import re

import pytest

from gearshift.rl.rewards import load_reward
from gearshift.rl.tasks import TASK_REWARDS, TASKS, arithmetic, make_task, reverse, write_jsonl


def test_addition_rows_are_correct_short_and_seeded():
    rows = make_task("add", 200, seed=3, digits=2)
    for row in rows:
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"]).groups()
        assert int(row["answer"]) == int(a) + int(b)
        assert int(a) <= 99 and int(b) <= 99 and len(row["prompt"]) <= 6
    assert rows == make_task("add", 200, seed=3, digits=2)
    assert rows != make_task("add", 200, seed=4, digits=2)
    assert max(len(r["prompt"]) for r in make_task("add", 200, digits=1)) <= 4


def test_arithmetic_ops_evaluate_and_subtraction_stays_non_negative():
    for row in arithmetic(300, seed=1, digits=2, ops="+-*"):
        expr = row["prompt"][:-1]
        assert int(row["answer"]) == eval(expr)  # the prompt is a valid Python expression
        assert int(row["answer"]) >= 0
    assert {r["prompt"][1:-1].strip("0123456789") for r in arithmetic(300, ops="+-*")} == {"+", "-", "*"}
    with pytest.raises(ValueError, match="ops='/'"):
        arithmetic(3, ops="/")


def test_reverse_rows():
    rows = reverse(50, seed=0, min_len=2, max_len=4)
    for row in rows:
        word = re.fullmatch(r"rev ([a-z]{2,4})=", row["prompt"]).group(1)
        assert row["answer"] == word[::-1]


def test_each_task_is_solved_by_its_reward():
    for name in TASKS:
        reward = load_reward(TASK_REWARDS[name])
        row = make_task(name, 1, seed=5)[0]
        assert reward(row["answer"], **row) == 1.0
        assert reward(row["answer"] + "1", **row) == 0.0


def test_unknown_task_and_write_jsonl(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'sum'; built-in tasks: add, arith, reverse"):
        make_task("sum")
    rows = make_task("reverse", 5)
    path = write_jsonl(rows, tmp_path / "sub" / "rev.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
