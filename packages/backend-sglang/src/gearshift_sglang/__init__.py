"""gearshift-sglang: rollout backend `sglang`, SGLang's engine colocated with the trainer."""

from .engine import SGLangRolloutEngine

__all__ = ["SGLangRolloutEngine"]
