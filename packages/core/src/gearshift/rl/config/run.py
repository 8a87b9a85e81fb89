"""The run section of the run config: steps, output, logging, and where the roles run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from .base import Section


@dataclass
class PoolsConfig(Section):
    """run.placement=split: the workers of each pool, and where the other models run."""

    train: int = 1
    """Workers (one device each) that train the policy (and the critic)."""
    rollout: int = 1
    """Workers (one device each) that run the rollout engine."""
    reference: Literal["train", "rollout"] = "train"
    """The pool whose workers hold the KL reference."""
    reward_model: Literal["rollout", "train"] = "rollout"
    """The pool whose workers hold reward.model."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    """auto (a GPU per worker when the cluster has GPUs), cpu or gpu."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker."""

    def problems(self, at: str) -> list[str]:
        found = [f"{at}{role}={getattr(self, role)} must be >= 1" for role in ("train", "rollout")
                 if getattr(self, role) < 1]
        if self.cpus_per_worker <= 0:
            found.append(f"{at}cpus_per_worker={self.cpus_per_worker} must be > 0")
        return found


@dataclass
class RunConfig(Section):
    """The run itself: how long, where its output goes, what it logs, where its roles run."""

    steps: int = 120
    """RL steps: each generates, scores and trains on one batch."""
    prompts_per_step: int = 32
    """Prompts each step samples for (times rollout.n completions)."""
    seed: int = 0
    """Seed of the run: the engines' random generators and each step's sampling."""
    output_dir: str = "runs/default"
    """Where metrics, logs, checkpoints and the reward curve go."""
    checkpoint_every: int = 40
    """Save a checkpoint every this many steps; 0: never."""
    resume: str = "auto"
    """auto (from the latest checkpoint under output_dir, if any), never, or a checkpoint folder."""
    tensorboard: bool = True
    """Write TensorBoard logs."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = "gearshift"
    """The Weights & Biases project."""
    samples_per_step: int = 2
    """Completions printed each step."""
    eval_every: int = 0
    """Evaluate on data.val_path every this many steps (and after the last); 0: after the last only."""
    eval_greedy: bool = True
    """Evaluation decodes greedily (one completion a prompt); false: with the rollout's sampling."""
    plot: bool = True
    """Draw the reward curve (reward.png)."""
    progress: bool = True
    """Show a progress bar."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: every role on every rank, one process per device (torchrun); split: training and rollout on
    separate pools of workers started by Ray, driven by this process (run.pools sizes them)."""
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    """run.placement=split: the pools of workers."""
    ray_address: str | None = None
    """split: the Ray cluster to join ('auto', 'host:6379'); null: start one here."""

    def problems(self, at: str) -> list[str]:
        found = [f"{at}{key}={getattr(self, key)} must be >= 1" for key in ("steps", "prompts_per_step")
                 if getattr(self, key) < 1]
        for key, meaning in (("checkpoint_every", "never"), ("eval_every", "evaluate after the last step only")):
            if getattr(self, key) < 0:
                found.append(f"{at}{key}={getattr(self, key)} must be >= 0 (0: {meaning})")
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            found.append(f"{at}resume={self.resume!r}: use 'auto', 'never' or an existing checkpoint folder")
        return found
