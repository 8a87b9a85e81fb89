"""The `agent` section of the run config (it lives with the other sections, in `gearshift.rl.config.agent`)."""

from ..config.agent import FORMATS, AgentConfig

__all__ = ["FORMATS", "AgentConfig"]
