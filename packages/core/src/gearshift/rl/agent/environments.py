"""Environments: state that lives through one episode, answers each model turn, and may own its reward.

    class Guess(Environment):
        def reset(self, row):                 # the dataset row (every column); once per sample
            self.target = int(row["answer"])
        def step(self, text):                 # the model's turn, as text
            guess = int(text.strip() or -1)
            if guess == self.target:
                return "", True, 1.0          # (observation, done, reward)
            return ("higher" if guess < self.target else "lower"), False, None

One instance per sample: `agent.environment` names the class ('module:Class' or 'file.py:Class'),
or a row's own column (`agent.environment_key`) does. The observation's tokens are appended to the
episode (and kept out of the loss); `done` ends it; a reward, when one is given, is the sample's
(the last one given counts), otherwise the run's reward function scores the last turn's text.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from .tools import ToolError, load_object



class AgentError(ValueError):
    """An environment that failed (raised, or answered something unusable); the message names the row."""


class Environment:
    """Subclass it (or write any class with the same two methods)."""

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start an episode on `row`; a returned text is appended to the prompt before the first turn."""
        return None

    def step(self, text: str) -> tuple[str, bool, float | None]:
        """The model's turn `text` -> (observation appended to the episode, done, reward or None)."""
        raise NotImplementedError


def load_environment(spec: Any) -> type:
    """The environment class a 'module:Class' or 'path/to/file.py:Class' string names (or a class)."""
    cls = spec if inspect.isclass(spec) else load_object(spec, "environment")
    if not inspect.isclass(cls):
        raise ToolError(f"environment {spec!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ToolError(f"environment {spec!r} has no {' and no '.join(missing)} method: an environment has "
                        f"reset(row) and step(text) -> (observation, done, reward)")
    return cls


def check_step(value: Any, name: str, origin: str) -> tuple[str, bool, float | None]:
    """A step's answer as (observation, done, reward), or an `AgentError` naming the row."""
    import math
    import numbers

    if not (isinstance(value, tuple) and len(value) == 3):
        raise AgentError(f"{origin}: environment {name}.step returned {value!r}; return (observation, done, "
                         f"reward or None)")
    observation, done, reward = value
    if observation is None:
        observation = ""
    if not isinstance(observation, str):
        raise AgentError(f"{origin}: environment {name}.step returned an observation of type "
                         f"{type(observation).__name__}; return text")
    if reward is not None:
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise AgentError(f"{origin}: environment {name}.step returned the reward {reward!r}; return a finite "
                             f"float or None")
        reward = float(reward)
    return observation, bool(done), reward
