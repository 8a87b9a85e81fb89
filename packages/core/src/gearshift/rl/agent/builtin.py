"""The built-in tasks' tool and environment: a calculator (`data.task=calc`) and a number to guess with
higher/lower answers (`data.task=guess`)."""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Mapping

from .environments import Environment

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    """Evaluate integer arithmetic (+, -, *), e.g. '12+7'."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"{expression!r} is not integer arithmetic")

    if len(expression) > 64:
        raise ValueError("the expression is longer than 64 characters")
    return str(value(ast.parse(expression.strip(), mode="eval").body))


class GuessNumber(Environment):
    """Guess the row's `answer` (an integer): each wrong guess is told `higher` or `lower`; reward 1 for the
    right number, 0 when the turns run out (or the turn holds no number)."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self.target = int(row["answer"])

    def step(self, text: str) -> tuple[str, bool, float | None]:
        found = re.findall(r"-?\d+", text)
        if not found:
            return " number? ", False, 0.0
        guess = int(found[-1])
        if guess == self.target:
            return "", True, 1.0
        return (" higher " if guess < self.target else " lower "), False, 0.0


def digits_match(completion: str, answer: Any) -> float:
    """1.0 for the answer's number alone; else the share of its digits right in place (counted from the
    right, over the longer of the two), so a model learning to read a tool's answer earns credit digit by
    digit; 0.0 for a completion that is not a number."""
    text, answer = completion.strip(), str(answer).strip()
    if text == answer:
        return 1.0
    if not text.isdigit():
        return 0.0
    same = sum(a == b for a, b in zip(reversed(text), reversed(answer)))
    return same / max(len(text), len(answer))
