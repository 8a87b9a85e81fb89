"""`gearshift.rewards:fn`, the name configs give the built-in rewards, kept working: they live in
`gearshift.rl.rewards`."""

from .rl.rewards import (  # noqa: F401
    Reward, RewardError, combine_rewards, exact_match, format_match, load_reward, numeric_match,
    strict_numeric_match,
)

__all__ = ["Reward", "RewardError", "combine_rewards", "exact_match", "format_match", "load_reward", "numeric_match",
           "strict_numeric_match"]
