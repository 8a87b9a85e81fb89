"""Train backend `torch`: plain PyTorch, one process, any `AutoModelForCausalLM` from a local path.

It is `ModuleTrainEngine` with no sharding: the reference the sharded
backends are checked against.
"""

from __future__ import annotations

from ..module_train import ModuleTrainEngine


class TorchTrainEngine(ModuleTrainEngine):
    """AdamW on one device, one process; micro-batched steps with gradient clipping."""

    contract = 2


__all__ = ["TorchTrainEngine"]
