"""Run configuration: typed dataclasses are the one source of truth, filled through OmegaConf.

A YAML file fills them, then dotted overrides from the command line
(`rollout.backend=vllm train.lr=1e-5`); values may interpolate others
(`run.output_dir: runs/${algorithm.name}`). OmegaConf checks names and types as
it merges, choices included (`Literal` fields); `validate()` then runs each
section's own checks and the rules across sections, up front, and says what to
change. Every error names the file (with line and column), the override or the
key it comes from. Each key is documented by the string under its field, which
`gearshift train --print-config` shows beside it. null means unset (the
algorithm's own, the model's own, ...); older files' 0 or '' for it still read.
"""

from .algorithm import GAE_NORMS, AlgorithmConfig
from .base import ConfigError, Section, field_help
from .loading import build_config, load_config, normalise
from .root import MISMATCH_EVERY, Config
from .run import PoolsConfig, RunConfig
from .sections import (
    SHARE, DataConfig, LoraConfig, ModelConfig, RewardConfig, RolloutConfig, SwitchConfig, TrainConfig, parse_offload,
)

__all__ = [
    "GAE_NORMS", "MISMATCH_EVERY", "SHARE", "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "LoraConfig",
    "ModelConfig", "PoolsConfig", "RewardConfig", "RolloutConfig", "RunConfig", "Section", "SwitchConfig",
    "TrainConfig", "build_config", "field_help", "load_config", "normalise", "parse_offload",
]
