"""Resumable run checkpoints: engines, loop state and every rank's RNG, marked complete only when whole.

A run killed while writing leaves a folder without the `COMPLETE` marker,
which `latest` skips, so resuming never starts from half a checkpoint. Ctrl-C
during a write lets the write finish and stops after it (a second Ctrl-C
stops at once): a KeyboardInterrupt raised inside torch's writers leaves a
file cut short and comes back as some other error (seen: "unexpected pos" from
torch.save, wrapped in a CheckpointException), not as Ctrl-C. The
loop state is JSON and the RNG states are tensors in safetensors files:
reading a checkpoint runs no code from it.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .. import dist as gdist
from ..train import TrainEngine

MARKER = "COMPLETE"


def save_rng_state(path: Path) -> None:
    """Python's, torch's and every CUDA device's generator state, as tensors in a safetensors file."""
    from safetensors.torch import save_file

    version, words, gauss = random.getstate()
    tensors = {"python": torch.tensor(words, dtype=torch.int64), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(tensors, str(path), metadata={"python_version": str(version), "python_gauss": json.dumps(gauss)})


def load_rng_state(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    random.setstate((int(meta["python_version"]), tuple(tensors["python"].tolist()), json.loads(meta["python_gauss"])))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda{i}"] for i in range(len(tensors)) if f"cuda{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = [p for p in Path(root).glob("step_*") if (p / MARKER).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def to_resume(resume: str, root: str | Path) -> Path | None:
    """The checkpoint `run.resume` names: none for 'never', the latest under `root` for 'auto', else that folder."""
    if resume == "never":
        return None
    return Path(resume) if resume != "auto" else latest(root)


def resumed(path: str | Path, step: int, steps: int) -> str:
    """The line a run prints on resuming from checkpoint `path` at `step` of `steps`."""
    line = f"gearshift: resumed from {path} at step {step}"
    if step >= steps:
        line += (f"; run.steps={steps}: nothing left to train (raise run.steps to go on, or run.resume=never to "
                 f"start over in this output_dir)")
    return line


def save(root: str | Path, step: int, engines: Mapping[str, TrainEngine], state: Mapping[str, Any],
         keep: int = 2) -> Path:
    """Write checkpoint `step` (every rank calls this) and keep the newest `keep` complete ones.

    Ctrl-C while it writes raises KeyboardInterrupt once the checkpoint is complete (`ctrl_c_after`)."""
    with ctrl_c_after(f"checkpoint {step} is written"):
        return _save(root, step, engines, state, keep)


@contextlib.contextmanager
def ctrl_c_after(what: str) -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then raise KeyboardInterrupt; a second Ctrl-C raises at once.

    Only in the main thread and where SIGINT has Python's own handler (a program
    that set its own keeps it). An error inside the block is raised as it is.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed: list[bool] = []

    def held(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)
        if gdist.rank() == 0:
            print(f"gearshift: Ctrl-C: stopping once {what} (Ctrl-C again stops now, without it)",
                  file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _save(root: str | Path, step: int, engines: Mapping[str, TrainEngine], state: Mapping[str, Any],
          keep: int) -> Path:
    path = Path(root) / f"step_{step:06d}"
    rank = gdist.rank()
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    gdist.barrier()
    for name, engine in engines.items():
        engine.save(str(path / name))
    path.mkdir(parents=True, exist_ok=True)
    save_rng_state(path / f"rng_rank{rank}.safetensors")
    if rank == 0:
        (path / "loop_state.json").write_text(json.dumps(dict(state), indent=1))
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
    rng_file = path / f"rng_rank{gdist.rank()}.safetensors"
    if rng_file.exists():  # a rank the writing run did not have starts from its own seed
        load_rng_state(rng_file)
    return json.loads((path / "loop_state.json").read_text())
