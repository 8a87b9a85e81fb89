"""What every section of the run config shares: its own checks, the help of its keys, its choice fields."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot run, with what to change."""


class Section:
    """A section of the run config (a dataclass). Each field is documented by the string under it, read by
    `field_help` (and shown by `gearshift train --print-config`); `problems` checks what needs no other
    section."""

    def problems(self, at: str) -> list[str]:
        """What is wrong with this section's own values, each naming its key; `at` is where the section sits,
        e.g. 'model.lora.'."""
        return []

    def all_problems(self, at: str = "") -> list[str]:
        """`problems` of this section and of every section inside it."""
        found = self.problems(at)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                found += value.all_problems(f"{at}{f.name}.")
        return found


def choices_of(hint: Any) -> tuple | None:
    """The values a `Literal` type (or an optional one) allows; None for any other type."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def is_optional(hint: Any) -> bool:
    """Whether `hint` takes None (`X | None`)."""
    return type(None) in typing.get_args(hint)


def use_one_of(choices: tuple) -> str:
    """'use a or b', 'use one of a, b, c'."""
    words = [str(c) for c in choices]
    return f"use {words[0]} or {words[1]}" if len(words) == 2 else f"use one of {', '.join(words)}"


def choice_problem(key: str, value: Any, choices: tuple) -> str:
    return f"{key}={value!r}: {use_one_of(choices)}"


def section_hints(cls: type) -> dict[str, Any]:
    """The field types of section `cls`, resolved."""
    return typing.get_type_hints(cls)


def section_of(hint: Any) -> type | None:
    """The section class `hint` names, or None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """The attribute docstrings of dataclass `cls`: for each field, the string literal right under it, on one
    line. Read from the class's source, so the docstrings are the one place a key is documented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    found = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            found[node.target.id] = " ".join(after.value.value.split())
    return found


def commented_yaml(section: Any, indent: int = 0, width: int = 110) -> str:
    """`section` as YAML, each key under its help as a comment (wrapped to `width`)."""
    from omegaconf import OmegaConf

    helps, pad, lines = field_help(type(section)), " " * indent, []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        lines += [f"{pad}# {line}" for line in textwrap.wrap(helps.get(f.name, ""), width - indent - 2)]
        if dataclasses.is_dataclass(value):
            lines += [f"{pad}{f.name}:", commented_yaml(value, indent + 2, width)]
            if indent == 0:
                lines.append("")
        else:
            lines += [pad + line for line in OmegaConf.to_yaml({f.name: value}).rstrip("\n").splitlines()]
    return "\n".join(lines)
