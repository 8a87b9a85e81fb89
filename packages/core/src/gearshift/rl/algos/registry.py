"""Name -> function tables for advantage estimators and policy losses.

A config names an algorithm by a short string (`grpo`, `ppo_clip`); a typo
must fail with the list of known names rather than a bare KeyError. Each
registered function takes its data positionally (or as the fixed keywords
the kind declares) and its options keyword-only, so the options a config
may set are read off the signature.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Iterable, Mapping, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """Functions of one kind, by name; `data` are the parameters every one of them must accept."""

    def __init__(self, kind: str, data: Iterable[str] = ()) -> None:
        self.kind = kind
        self.data = tuple(data)
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; a second function under a taken name is an error."""

        def add(fn: F) -> F:
            held = self._fns.get(name)
            if held is not None and _where(held) != _where(fn):  # the same function re-imported is fine
                raise ValueError(f"{self.kind} {name!r} is already registered ({_where(held)}); pick another name")
            params = inspect.signature(fn).parameters
            missing = [p for p in self.data if p not in params]
            if missing:
                raise TypeError(f"{self.kind} {name!r} ({_where(fn)}) must accept {', '.join(self.data)}; "
                                f"it lacks {', '.join(missing)}")
            self._fns[name] = fn
            return fn

        return add

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._fns:
            raise ValueError(self._unknown(name))
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def options(self, name: str) -> list[str]:
        """The keyword-only parameters of `name` other than its data: what a config may set."""
        params = inspect.signature(self.get(name)).parameters.values()
        return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in self.data]

    def check_options(self, name: str, options: Mapping[str, Any]) -> None:
        allowed = self.options(name)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            listed = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"{self.kind} {name!r} has no option {', '.join(map(repr, unknown))}; "
                             f"its options are: {listed}")

    def _unknown(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self._fns, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; known: {', '.join(self.names())}"


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


ADVANTAGES = Registry("advantage estimator", data=("rewards", "mask", "group_ids", "values"))
POLICY_LOSSES = Registry("policy loss", data=("logprobs", "old_logprobs", "advantages", "mask"))


def register_advantage(name: str) -> Callable[[F], F]:
    """`fn(rewards, mask, *, group_ids, values, **options) -> (advantages [B, T], returns [B, T])`."""
    return ADVANTAGES.register(name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """`fn(logprobs, old_logprobs, advantages, mask, **options) -> (token_losses [B, T], metrics)`."""
    return POLICY_LOSSES.register(name)


def get_advantage(name: str) -> Callable[..., Any]:
    return ADVANTAGES.get(name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    return POLICY_LOSSES.get(name)
