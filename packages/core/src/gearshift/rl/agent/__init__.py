"""Multi-turn rollout: tools the model calls, environments that answer it, and the episode loop over any
rollout engine (see `episode`).

    from gearshift.rl.agent import Agent, AgentConfig, Environment
    agent = Agent(AgentConfig(tools=["my_tools.py:calc"], max_turns=3), tokenizer)
    rollouts = agent.run(engine.generate, rows, prompt_ids, SamplingParams(n=8, max_tokens=16))
"""

from .config import AgentConfig
from .environments import AgentError, Environment, load_environment
from .episode import LOSS_MASK, Agent, episode_metrics
from .formats import ChatFormat, TextFormat, make_format
from .tools import Tool, ToolError, ToolResult, load_tool, load_tools

__all__ = ["LOSS_MASK", "Agent", "AgentConfig", "AgentError", "ChatFormat", "Environment", "TextFormat", "Tool",
           "ToolError", "ToolResult", "episode_metrics", "load_environment", "load_tool", "load_tools",
           "make_format"]
