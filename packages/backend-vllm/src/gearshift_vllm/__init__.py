"""gearshift rollout backend on vLLM (`rollout.backend=vllm`). vLLM itself is imported only when an engine is built."""

from .engine import VLLMRolloutEngine

__all__ = ["VLLMRolloutEngine"]
