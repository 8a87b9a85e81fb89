"""The `agent` section of a run's config: tools, environments and the limits of an episode.

An episode runs when the section names a tool or an environment (or the built-in task needs one, as
`data.task=calc` does); otherwise every sample is one completion, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .base import Section

#: how a model calls a tool: auto (the chat template's format where it renders tools, else text), text
#: (`<tool>name(args)</tool>`, or `<name>argument</name>` for a tool of one argument) or chat (the template's
#: JSON tool calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
FORMATS = ("auto", "text", "chat")


@dataclass
class AgentConfig(Section):
    """Multi-turn episodes: the tools the model may call, the environment that answers it, the limits."""

    tools: list[str] = field(default_factory=list)
    """Tools the model may call: 'module:fn' or 'path/to/file.py:fn' (the argument schema comes from the
    signature)."""
    environment: str | None = None
    """The environment of every row: 'module:Class' or 'path/to/file.py:Class' with reset(row) and step(text);
    a row's own environment_key column, when set, wins."""
    environment_key: str = "environment"
    """The column naming a row's environment class."""
    environment_options: dict[str, Any] = field(default_factory=dict)
    """Keywords for every environment's __init__."""
    max_turns: int = 4
    """Model turns per episode at most."""
    max_tokens: int = 64
    """Tokens per episode after the prompt (the model's and the tools' together)."""
    format: Literal["auto", "text", "chat"] = "auto"
    """How tool calls are written: auto (the chat template's where it renders tools, else text), text, chat."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a model's turn (besides its end token)."""
    tool_timeout: float = 5.0
    """Seconds a tool call may take before the model is told it timed out."""

    def enabled(self, task: str | None = None) -> bool:
        """Whether samples are episodes: a tool or an environment is named (or the built-in task has one)."""
        from ..tasks import TASK_AGENTS

        return bool(self.tools or self.environment or (task in TASK_AGENTS))

    def problems(self, at: str = "agent.") -> list[str]:
        """What cannot run in the section's own values, each naming its key."""
        problems = []
        if self.max_turns < 1:
            problems.append(f"{at}max_turns={self.max_turns} must be >= 1")
        if self.max_tokens < 1:
            problems.append(f"{at}max_tokens={self.max_tokens} must be >= 1")
        if self.format not in FORMATS:
            problems.append(f"{at}format={self.format!r}: use one of {', '.join(FORMATS)}")
        if not self.tool_timeout > 0:
            problems.append(f"{at}tool_timeout={self.tool_timeout} must be > 0 (seconds)")
        if not self.environment_key:
            problems.append(f"{at}environment_key is empty: name the column of a row's environment")
        for i, spec in enumerate(self.tools):
            if not isinstance(spec, str) or ":" not in spec:
                problems.append(f"{at}tools[{i}]={spec!r}: name a tool as 'module:fn' or 'path/to/file.py:fn'")
        if isinstance(self.environment, str) and ":" not in self.environment:
            problems.append(f"{at}environment={self.environment!r}: name a class as 'module:Class' or "
                            f"'path/to/file.py:Class'")
        if any(not s for s in self.stop):
            problems.append(f"{at}stop holds an empty string: every stop string needs a character")
        return problems

    def limit_problems(self, *, max_prompt_len: int, max_model_len: int | None, turn_tokens: int) -> list[str]:
        """The episode's limits against the context and one turn (rules across the data and rollout sections)."""
        problems = []
        if max_model_len is not None and max_prompt_len + self.max_tokens > max_model_len:
            problems.append(f"data.max_prompt_len={max_prompt_len} + agent.max_tokens={self.max_tokens} is more "
                            f"than the context of {max_model_len} tokens: lower one of them (or raise "
                            f"rollout.max_model_len)")
        if self.max_tokens < turn_tokens:
            problems.append(f"agent.max_tokens={self.max_tokens} is less than one turn's rollout.max_tokens="
                            f"{turn_tokens}: an episode holds at least one turn, so raise agent.max_tokens")
        return problems
