"""Rewards: plain Python functions `fn(completion: str, **row) -> float | None`, named by a string.

    reward = load_reward("my_rewards.py:score")            # a file
    reward = load_reward("gearshift.rl.rewards:numeric_match")  # a module
    reward = load_reward({"gearshift.rl.rewards:exact_match": 1.0, "checks.py:short": 0.1})  # weighted sum
    reward("19", prompt="12+7=", answer="19")  # -> 1.0

The function receives the dataset row's columns as keywords: it may name
the ones it wants (`def score(completion, answer)`) or take `**row`.
Returning None drops the sample from the step (e.g. the grader failed).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

class RewardError(ValueError):
    """A reward that cannot be loaded, cannot be called with a row, or returned something unusable."""


class Reward:
    """A loaded reward function: checks what it is given and what it returns, and names itself in errors."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, **options: Any) -> None:
        if not callable(fn):
            raise RewardError(f"reward {name or fn!r} is a {type(fn).__name__}, not a function")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        self.options = options
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # some builtins have no signature: pass every column
            params = []
            self._takes_all = True
        else:
            self._takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        if params and params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD,
                                             params[0].VAR_POSITIONAL):
            raise RewardError(f"reward {self.name!r} must take the completion as its first argument")
        named = [p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self._accepts = {p.name for p in named}
        self._requires = {p.name for p in named if p.default is p.empty} - set(options)
        unknown = set(options) - self._accepts
        if unknown and not self._takes_all:
            raise RewardError(f"reward {self.name!r} has no parameter {', '.join(sorted(unknown))}; "
                              f"it takes {', '.join(sorted(self._accepts)) or 'only the completion'}")

    def check_columns(self, columns: Iterable[str]) -> None:
        """Raise, before any rollout, when the dataset lacks a column the reward needs."""
        missing = sorted(self._requires - set(columns))
        if missing:
            raise RewardError(f"reward {self.name!r} needs the column(s) {', '.join(missing)}; "
                              f"the dataset has {', '.join(sorted(columns))}")

    def __call__(self, completion: str, **row: Any) -> float | None:
        self.check_columns(row)
        kwargs = row if self._takes_all else {k: v for k, v in row.items() if k in self._accepts}
        try:
            value = self.fn(completion, **{**kwargs, **self.options})
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(f"reward {self.name!r} raised {type(err).__name__}: {err} "
                              f"(completion {_short(completion)})") from err
        return _check_value(self.name, value, completion)

    def __repr__(self) -> str:
        return f"Reward({self.name!r})"


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _check_value(name: str, value: Any, completion: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real):  # bool, int, float and numpy scalars are Real
        hint = " (call .item() on a tensor)" if hasattr(value, "item") else ""
        raise RewardError(f"reward {name!r} returned {value!r} of type {type(value).__name__} for completion "
                          f"{_short(completion)}: return a float, or None to drop the sample{hint}")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value} for completion {_short(completion)}: "
                          f"return a finite float, or None to drop the sample")
    return value


def public_functions(module) -> list[str]:
    """The functions a module offers: those `__all__` names, or else the public ones it defines or imports."""
    import inspect

    names = getattr(module, "__all__", None)
    if names is None:
        names = [k for k in vars(module) if not k.startswith("_")]
    return sorted(k for k in names if inspect.isfunction(getattr(module, k, None)))


def load_reward(spec: Any, **options: Any) -> Reward:
    """A `Reward` from 'module:fn', 'path/to/file.py:fn', a callable, or a {spec: weight} mapping.

    `options` are passed to the function as keywords on every call (e.g. tol=0.01).
    """
    if isinstance(spec, Reward):
        return spec
    if isinstance(spec, Mapping):
        if options:
            raise RewardError("options apply to one reward; give combined rewards as already-loaded Rewards")
        return combine_rewards(spec)
    if callable(spec):
        return Reward(spec, **options)
    if not isinstance(spec, str):
        raise RewardError(f"a reward is a 'module:function' string, a file path 'file.py:function', "
                          f"or a callable; got {type(spec).__name__}")
    where, sep, fn_name = spec.rpartition(":")
    if not sep or not where or not fn_name:
        raise RewardError(f"reward {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    module = module_of(where, spec)
    if not hasattr(module, fn_name):
        offered = public_functions(module)
        raise RewardError(f"reward {spec!r}: {where} has no function {fn_name!r}; "
                          f"it offers: {', '.join(offered) or 'no public functions'}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {fn_name} is a {type(fn).__name__}, not a function")
    return Reward(fn, name=spec, **options)


def module_of(where: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    """The module the `where` part of a 'where:name' spec names: a file path, or a module to import. A
    failure raises `error`, naming the spec as a `what` (a reward; the agent's loader: a tool, an environment)."""
    return (_load_file if _is_path(where) else _import)(where, spec, what, error)


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _load_file(where: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise error(f"{what} {spec!r}: file {where} not found (looked at {path})")
    # a stable, unique module name, registered so that pickling and dataclasses in the file work
    name = f"gearshift_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise error(f"{what} {spec!r}: importing {where} failed: {type(err).__name__}: {err}") from err
    return module


def _import(where: str, spec: str, what: str = "reward", error: type[Exception] = RewardError):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name and where.startswith(err.name):
            raise error(f"{what} {spec!r}: no module named {where!r}; install it, or name a file "
                        f"as path/to/file.py:function") from err
        raise error(f"{what} {spec!r}: importing {where} failed: {err}") from err
    except Exception as err:
        raise error(f"{what} {spec!r}: importing {where} failed: {type(err).__name__}: {err}") from err


def combine_rewards(weighted: Mapping[Any, float] | Iterable[tuple[Any, float]]) -> Reward:
    """The weighted sum of several rewards; a sample any of them drops (None) is dropped."""
    pairs = list(weighted.items() if isinstance(weighted, Mapping) else weighted)
    if not pairs:
        raise RewardError("combine_rewards got no rewards")
    parts = [(load_reward(spec), float(w)) for spec, w in pairs]

    def combined(completion: str, **row: Any) -> float | None:
        total = 0.0
        for reward, weight in parts:
            value = reward(completion, **row)
            if value is None:
                return None
            total += weight * value
        return total

    reward = Reward(combined, name=" + ".join(f"{w:g}*{r.name}" for r, w in parts))
    reward._requires = set().union(*(r._requires for r, _ in parts))
    return reward


# --- built-in rewards ---------------------------------------------------------------------

# a minus sign right after a digit is subtraction ("5-3"), not a sign; thousands separators are allowed
_NUMBER = re.compile(r"(?<!\d)-?\d+(?:,\d{3})*(?:\.\d+)?")


# a strict answer: the number alone, whitespace around it, and at most one closing punctuation mark after it
_STRICT_PUNCTUATION = ".!?,;:"
_STRICT_NUMBER = re.compile(rf"\s*({_NUMBER.pattern})\s*[{re.escape(_STRICT_PUNCTUATION)}]?\s*")


def _numbers(text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in _NUMBER.findall(text)]


def _as_number(answer: Any) -> float:
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer).strip()
    if not _NUMBER.fullmatch(text):
        raise ValueError(f"the row's answer {answer!r} is not a number; use exact_match for text answers")
    return float(text.replace(",", ""))


def exact_match(completion: str, answer: Any) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the row's answer."""
    return float(completion.strip() == str(answer).strip())


def numeric_match(completion: str, answer: Any, *, which: str = "last", tol: float = 1e-6,
                  strict: bool = False) -> float:
    """1.0 when the first or last number in the completion equals the answer within `tol`.

    `strict=True`: the completion must be the number and nothing else, but whitespace around it and
    one closing punctuation mark after it (one of . ! ? , ; :): ' 9', '9.' and '9 !' are 9, while
    'X9', '9 apples', 'it is 9' and '9..' score 0.
    """
    if which not in ("first", "last"):
        raise ValueError(f"which={which!r}: use 'first' or 'last'")
    target = _as_number(answer)
    if strict:
        alone = _STRICT_NUMBER.fullmatch(completion)
        found = [float(alone.group(1).replace(",", ""))] if alone else []
    else:
        found = _numbers(completion)
    if not found:
        return 0.0
    return float(abs(found[0 if which == "first" else -1] - target) <= tol)


def strict_numeric_match(completion: str, answer: Any, *, tol: float = 1e-6) -> float:
    """`numeric_match(strict=True)`, by name: 1.0 when the completion is the answer's number alone."""
    return numeric_match(completion, answer, tol=tol, strict=True)


def format_match(completion: str, *, pattern: str) -> float:
    """1.0 when the whole stripped completion matches the regular expression `pattern` (a format reward)."""
    return float(re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is not None)
