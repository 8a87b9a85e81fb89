"""The memory tags of the switch protocol: what a train engine offloads and a rollout engine puts to sleep."""

from __future__ import annotations

from typing import Sequence

TRAIN_TAGS = ("params", "grads", "optimizer")
ROLLOUT_TAGS = ("weights", "kv_cache")


def check_tags(tags: str | Sequence[str], allowed: Sequence[str]) -> list[str]:
    """`tags` as a list; a `ValueError` names any tag not in `allowed`."""
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = [t for t in tags if t not in allowed]
    if unknown:
        raise ValueError(f"unknown tags {unknown}; use any of {list(allowed)}")
    return tags
