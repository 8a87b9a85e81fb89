"""Where per-step metrics go: the console, a jsonl file, TensorBoard, and wandb when asked for."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..profiler import pyplot


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by a killed run; everything after it is dropped on resume
    return rows


class MetricsLogger:
    """Writes each step's metrics to `metrics.jsonl` (and TensorBoard / wandb) under `output_dir`."""

    def __init__(self, output_dir: str | os.PathLike, *, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "gearshift", config: dict | None = None, enabled: bool = True) -> None:
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print("gearshift: tensorboard is not installed; metrics go to metrics.jsonl only")
        if wandb:
            try:
                import wandb as wandb_

                self._wandb = wandb_.init(project=wandb_project, config=config, dir=str(self.dir))
            except ImportError:
                print("gearshift: run.wandb=true but wandb is not installed (pip install wandb); skipping it")

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run redoes them)."""
        if not self.enabled:
            return
        rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_rewards(metrics_path: str | os.PathLike, png_path: str | os.PathLike,
                 keys: tuple[str, ...] = ("reward/mean", "eval/reward_mean")) -> bool:
    """Draw each of `keys` that was logged against the step to one PNG (the training reward, and the held-out
    one where a run evaluated); False when matplotlib is missing or none was logged."""
    plt = pyplot()
    if plt is None:
        return False
    logged = read_jsonl(metrics_path)
    series = {k: [r for r in logged if k in r] for k in keys}
    series = {k: rows for k, rows in series.items() if rows}
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, rows in series.items():
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if len(rows) > 20 else "o", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward per step")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True
