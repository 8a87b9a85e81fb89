"""The episode loop: turns of generation, each answered by a tool or an environment, over any rollout engine.

Every turn generates for all the samples still running at once, each from its whole context
(the prompt, the model's turns and the answers so far), so an engine with a prefix cache
serves the part it has seen from it. A turn ends at a tool call's closing string, an
`agent.stop` string, or the model's end token. The episode ends when the model answers without
calling a tool (or the environment says it is done), or at `agent.max_turns` turns or
`agent.max_tokens` tokens after the prompt.

The sample is a `Rollout` like any other: `token_ids` and `logprobs` over the whole episode after
the prompt (0 for tokens the model did not write), `text` the last turn's text (what the reward
reads), and in `extra`: `loss_mask` (1 on the model's tokens, 0 on the tools' and the environment's),
`turns`, `tool_calls`, `tool_errors`, the environment's `reward` when it gave one, and `episode`
(the whole episode's text).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ...rollout import Rollout, SamplingParams, text_before_stop
from .config import AgentConfig
from .environments import AgentError, check_step, load_environment
from .formats import ToolFormat, make_format, tool_schemas
from .tools import Tool, load_tools

Generate = Callable[[Sequence[Sequence[int]], SamplingParams], list[Rollout]]

#: the Rollout.extra key of the episode's loss mask (the trainer ANDs it with its own)
LOSS_MASK = "loss_mask"


@dataclass
class _Episode:
    prompt_ids: list[int]
    row: Mapping[str, Any]
    prompt_index: int
    sample_index: int
    env: Any = None
    env_name: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    last_text: str = ""
    done: bool = False
    finish_reason: str = "stop"
    no_logprobs: bool = False  # a model turn came without them: the episode has none

    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, model: bool) -> None:
        """The model's tokens with their logprobs (`model`), or a tool's or an environment's (`logprobs` None:
        0 each, masked out of the loss)."""
        given = list(logprobs) if logprobs is not None else []
        if len(given) != len(ids):
            self.no_logprobs = self.no_logprobs or model  # the model's call asked for none
            given = [0.0] * len(ids)
        self.token_ids += list(ids)
        self.logprobs += given
        self.mask += [int(model)] * len(ids)


def _origin(row: Mapping[str, Any], index: int) -> str:
    return getattr(row, "origin", "") or f"row {index}"


class Agent:
    """Tools, environments and limits of an `agent` config section, and the loop that runs episodes."""

    def __init__(self, config: AgentConfig, tokenizer, *, tools: Sequence[Any] = (), environment: Any = None,
                 max_model_len: int | None = None) -> None:
        self.config, self.tokenizer, self.max_model_len = config, tokenizer, max_model_len
        self.tools: dict[str, Tool] = load_tools([*config.tools, *tools], timeout=config.tool_timeout)
        self.format: ToolFormat = make_format(config.format, self.tools, tokenizer)
        self.environment = environment if environment is not None else config.environment
        self._classes: dict[Any, type] = {}
        if self.environment is not None:
            self._classes[self.environment] = load_environment(self.environment)  # a bad name fails at start-up

    @classmethod
    def from_config(cls, config, tokenizer, *, max_model_len: int | None = None) -> "Agent | None":
        """The agent of a run's `Config` (its `agent` section, and the built-in task's own tools), or None
        when its samples are single completions."""
        from ..tasks import TASK_AGENTS

        if not config.episodes():
            return None
        own = TASK_AGENTS.get(config.builtin_task(), {})
        agent_cfg = replace(config.agent, tools=[*own.get("tools", []), *config.agent.tools],
                            environment=config.agent.environment or own.get("environment"))
        return cls(agent_cfg, tokenizer, max_model_len=max_model_len)

    def schemas(self) -> list[dict]:
        """The tools as a chat template takes them (for prompts given as chat messages)."""
        return tool_schemas(self.tools) if self.format.name == "chat" else []

    # --- the loop -------------------------------------------------------------------------
    def _environment(self, row: Mapping[str, Any], origin: str):
        spec = row.get(self.config.environment_key) or self.environment
        if spec is None:
            return None, ""
        if spec not in self._classes:
            try:
                self._classes[spec] = load_environment(spec)
            except Exception as err:
                raise AgentError(f"{origin}: {err}") from err
        cls = self._classes[spec]
        try:
            return cls(**self.config.environment_options), cls.__name__
        except Exception as err:
            raise AgentError(f"{origin}: building environment {cls.__name__} raised {type(err).__name__}: "
                             f"{err}") from err

    def _tool_stops(self) -> list[str]:
        return self.format.stops() if self.tools else []

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def run(self, generate: Generate, rows: Sequence[Mapping[str, Any]], prompts: Sequence[Sequence[int]],
            sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` episodes per prompt, grouped by prompt in order like `RolloutEngine.generate`'s rollouts;
        `generate` is the engine's (or the switch's) generate, `rows` the prompts' dataset rows."""
        cfg = self.config
        stops = tuple(dict.fromkeys([*sampling.stop, *cfg.stop, *self._tool_stops()]))
        turn = replace(sampling, stop=stops)
        episodes: list[_Episode] = []
        opening: list[list[int]] = []
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            for k in range(sampling.n):
                origin = _origin(row, i)
                env, name = self._environment(row, origin)
                ep = _Episode(list(prompt), row, i, k, env, name)
                if env is not None:
                    columns = {c: v for c, v in row.items() if c != "prompt_ids"}
                    try:
                        first = env.reset(columns)
                    except Exception as err:
                        raise AgentError(f"{origin}: environment {name}.reset raised {type(err).__name__}: "
                                         f"{err}") from err
                    if first is not None and not isinstance(first, str):
                        raise AgentError(f"{origin}: environment {name}.reset returned {type(first).__name__}; "
                                         f"return text (appended to the prompt) or None")
                    opening.append(self._encode(first or ""))
                else:
                    opening.append([])
                episodes.append(ep)
        if any(opening):  # the environments' first words follow each sample's prompt: no sampling of n at once
            for ep, ids in zip(episodes, opening):
                ep.prompt_ids += ids
        else:  # the first turn samples n per prompt, from one prompt each (the engine's n-sampling)
            first = generate([list(p) for p in prompts], replace(turn, max_tokens=min(
                self._turn_tokens(ep, sampling.max_tokens) for ep in episodes)))
            for ep, x in zip(episodes, first):
                self._after_turn(ep, x)
        number = 0
        while True:
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            number += 1
            # the same turn budget goes to one call; they differ only near an episode's limits
            by_budget: dict[int, list[_Episode]] = {}
            for ep in live:
                by_budget.setdefault(self._turn_tokens(ep, sampling.max_tokens), []).append(ep)
            for budget, group in by_budget.items():
                seed = None if sampling.seed is None else sampling.seed + 7919 * number + budget
                out = generate([ep.context() for ep in group], replace(turn, n=1, max_tokens=budget, seed=seed))
                for ep, x in zip(group, out):
                    self._after_turn(ep, x)
        return [self._rollout(ep) for ep in episodes]

    def _turn_tokens(self, ep: _Episode, per_turn: int) -> int:
        """Tokens the model may write this turn: a turn's own limit, within the episode's and the context's."""
        room = self.config.max_tokens - len(ep.token_ids)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(ep.context()))
        return max(1, min(room, per_turn))

    def _after_turn(self, ep: _Episode, x: Rollout) -> None:
        """Take the model's turn `x`, and the tool's or environment's answer to it."""
        cfg, origin = self.config, _origin(ep.row, ep.prompt_index)
        ep.append(x.token_ids, x.logprobs, model=True)
        ep.turns += 1
        text = self.tokenizer.decode(x.token_ids, skip_special_tokens=True)
        ep.last_text = text_before_stop(text, [*cfg.stop, *self._tool_stops()]) if x.finish_reason == "stop" else text
        full = len(ep.token_ids) >= cfg.max_tokens or (
            self.max_model_len is not None and len(ep.context()) >= self.max_model_len)
        last = ep.turns >= cfg.max_turns or full
        call = self.format.parse(self.tokenizer.decode(x.token_ids)) if self.tools else None
        if call is not None and not last:
            result = self.format.run(call)
            ep.tool_calls += 1
            ep.tool_errors += int(result.error)
            self._answer(ep, self.format.observation(result, call, self.tokenizer.decode(x.token_ids)))
            return
        if ep.env is not None and call is None:
            try:
                value = ep.env.step(ep.last_text)
            except Exception as err:
                raise AgentError(f"{origin}: environment {ep.env_name}.step raised {type(err).__name__}: {err} "
                                 f"(turn {ep.turns}: {ep.last_text[:80]!r})") from err
            observation, done, reward = check_step(value, ep.env_name, origin)
            if reward is not None:
                ep.reward = reward
            if not (done or last):
                self._answer(ep, observation)
                return
            ep.done = True
            ep.finish_reason = "stop" if done else "length"
            return
        ep.done = True
        ended = x.finish_reason == "stop" and call is None
        ep.finish_reason = "stop" if ended else "length"

    def _answer(self, ep: _Episode, observation: str) -> None:
        """Append the answer's tokens (as many as the episode has room for); an episode out of room ends."""
        ids = self._encode(observation)
        room = self.config.max_tokens - len(ep.token_ids)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - 1 - len(ep.context()))
        ep.append(ids[:max(room, 0)], None, model=False)
        if len(ids) >= room:  # no room left for the model to answer
            ep.done, ep.finish_reason = True, "length"

    def _rollout(self, ep: _Episode) -> Rollout:
        extra = {LOSS_MASK: ep.mask, "turns": ep.turns, "tool_calls": ep.tool_calls,
                 "tool_errors": ep.tool_errors, "episode": self.tokenizer.decode(ep.token_ids)}
        if ep.reward is not None:
            extra["reward"] = ep.reward
        logprobs = [] if ep.no_logprobs else ep.logprobs
        return Rollout(ep.prompt_ids, ep.token_ids, logprobs, ep.finish_reason, ep.prompt_index, ep.sample_index,
                       text=ep.last_text, extra=extra)


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Turns, tool calls and errors per episode, its length, and the share of its tokens the model wrote."""
    episodes = [x for x in rollouts if LOSS_MASK in x.extra]
    if not episodes:
        return {}
    tokens = sum(len(x.token_ids) for x in episodes)
    model = sum(sum(x.extra[LOSS_MASK]) for x in episodes)
    mean = statistics.fmean
    return {"agent/turns_mean": mean(x.extra["turns"] for x in episodes),
            "agent/tool_calls_mean": mean(x.extra["tool_calls"] for x in episodes),
            "agent/tool_errors_mean": mean(x.extra["tool_errors"] for x in episodes),
            "agent/episode_len_mean": tokens / len(episodes),
            "agent/model_token_share": model / tokens if tokens else 1.0}
