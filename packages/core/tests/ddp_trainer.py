"""A trainer from outside gearshift: torch's DistributedDataParallel on `ModuleTrainEngine`.

It is what a third party writes: a `Sharding` saying how the model lies over
the ranks (every weight whole on every rank, gradients all-reduced in backward),
and an engine that passes it and writes its own checkpoint (rank 0, the state
being the same everywhere). Neither overrides a private name of the core's
classes. test_third_party_trainer.py runs the core's train conformance suite on
it, in one process and under torchrun with two (run as `pytest ddp_trainer.py`
there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gearshift import dist as gdist
from gearshift.conformance import TrainEngineSuite
from gearshift.mesh import MeshSpec
from gearshift.module_train import ModuleTrainEngine
from gearshift.sharding import Sharding
from gearshift.tags import TRAIN_TAGS


class DDPSharding(Sharding):
    """Every rank holds the whole model; DDP averages the gradients over the ranks during backward."""

    def check(self, mesh: MeshSpec) -> None:
        if mesh.dp != mesh.world_size:
            raise ValueError(f"data parallel only: mesh {mesh} has tp/pp/sp > 1; use dp={mesh.world_size}")

    def parallelize(self, model: nn.Module, hf_model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def trained_parameters(self, model: nn.Module):
        return ((n, p) for n, p in model.module.named_parameters() if p.requires_grad)


class DDPTrainEngine(ModuleTrainEngine):
    """AdamW under DistributedDataParallel over gloo (nccl on GPUs)."""

    contract = 2

    def __init__(self, args, options=None) -> None:
        options = options or self.Options()
        gdist.ensure_process_group(options.device)
        super().__init__(args, options, DDPSharding())

    def save(self, path: str) -> None:
        """Rank 0 writes model and optimizer (the same on every rank); `load` (the base's) reads them back."""
        self.need_onloaded(TRAIN_TAGS, "save a checkpoint")
        if gdist.rank() == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       os.path.join(path, "train_state.pt"))
        gdist.barrier()


class TestDDPTrain(TrainEngineSuite):
    train_backend = DDPTrainEngine

    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: DDPTrainEngine.build(gearshift_model, **kw)
