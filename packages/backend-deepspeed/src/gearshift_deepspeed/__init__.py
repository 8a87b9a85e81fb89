"""gearshift train backend on DeepSpeed ZeRO 1/2/3: `DeepSpeedTrainEngine`, registered as train backend `deepspeed`."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "DeepSpeedTrainEngine":  # imported on first use: `gearshift backends` lists it without DeepSpeed
        from .engine import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DeepSpeedTrainEngine"]
