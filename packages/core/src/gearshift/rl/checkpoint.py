"""Resumable run checkpoints: engines, loop state and every rank's RNG, marked complete only when whole.

A run killed while writing leaves a folder without the `COMPLETE` marker,
which `latest` skips, so resuming never starts from half a checkpoint.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from .. import dist as gdist
from ..train import TrainEngine

MARKER = "COMPLETE"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = [p for p in Path(root).glob("step_*") if (p / MARKER).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def save(root: str | Path, step: int, engines: Mapping[str, TrainEngine], state: Mapping[str, Any],
         keep: int = 2) -> Path:
    """Write checkpoint `step` (every rank calls this) and keep the newest `keep` complete ones."""
    path = Path(root) / f"step_{step:06d}"
    rank = gdist.rank()
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    gdist.barrier()
    for name, engine in engines.items():
        engine.save(str(path / name))
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(dict(state), path / "loop_state.pt")
    gdist.barrier()
    if rank == 0:
        (path / MARKER).write_text(str(step))
        complete = sorted((p for p in Path(root).glob("step_*") if (p / MARKER).exists()),
                          key=lambda p: int(p.name.split("_")[1]))
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    gdist.barrier()
    return path


def load(path: str | Path, engines: Mapping[str, TrainEngine]) -> dict[str, Any]:
    """Restore the engines and this rank's RNG from `path`; returns the loop state."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    for name, engine in engines.items():
        engine.load(str(path / name))
    rng_file = path / f"rng_rank{gdist.rank()}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(path / "loop_state.pt", weights_only=False)
