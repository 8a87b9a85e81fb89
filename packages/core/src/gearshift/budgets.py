"""Switch-latency budgets (budgets.yaml beside this file), per device class and pair."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

BUDGETS_FILE = Path(__file__).with_name("budgets.yaml")


@dataclass(frozen=True)
class Budget:
    """sync <= k * max(copy, engine load) + overhead_s; naive >= m * sync."""

    k: float
    overhead_s: float
    m: float

    def __post_init__(self) -> None:
        if self.m < 1.0:
            raise ValueError(f"budget m={self.m}: the streaming sync may not be slower than the naive file round "
                             f"trip it is measured against; m must be >= 1")
        if self.k <= 0 or self.overhead_s < 0:
            raise ValueError(f"budget k={self.k}, overhead_s={self.overhead_s}: k must be > 0 and overhead_s >= 0")

    def limit(self, copy_s: float, engine_load_s: float) -> float:
        return self.k * max(copy_s, engine_load_s) + self.overhead_s

    def with_overrides(self, text: str | None) -> "Budget":
        """Apply 'k=2,m=3' (keys k, m, overhead_s)."""
        if not text:
            return self
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("k", "m", "overhead_s"):
                raise ValueError(f"bad budget override {part!r}: write k=2,m=3,overhead_s=0.05")
            values[key] = float(value)
        return replace(self, **values)


def budget_for(device: str, train: str, rollout: str, path: Path = BUDGETS_FILE) -> Budget:
    """The budget of pair `train/rollout` on device class `device` ('cpu' or 'cuda')."""
    table = yaml.safe_load(path.read_text())
    if device not in table:
        raise ValueError(f"{path} has no budgets for device class {device!r}; it has {sorted(table)}")
    entry = dict(table[device]["default"])
    for pattern, values in (table[device].get("pairs") or {}).items():
        if fnmatch.fnmatch(f"{train}/{rollout}", pattern):
            entry.update(values)
    return Budget(float(entry["k"]), float(entry["overhead_s"]), float(entry["m"]))
