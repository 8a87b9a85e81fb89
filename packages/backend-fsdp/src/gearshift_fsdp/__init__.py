"""gearshift training backend on PyTorch FSDP2: `FSDPTrainEngine`, registered as train backend `fsdp`."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "FSDPTrainEngine":  # imported on first use: `gearshift backends` lists it without loading torch
        from .engine import FSDPTrainEngine

        return FSDPTrainEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FSDPTrainEngine"]
