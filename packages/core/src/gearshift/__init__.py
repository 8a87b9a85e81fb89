"""gearshift: RL post-training of LLMs with near-free switches between training and rollout.

The kernel is this package's top level: the engine interfaces (train.py,
rollout.py) and how engines are built (options.py), weights and meshes
(weights.py, mesh.py), resharding (reshard/), the registry of backends
(registry.py), the switch (hybrid.py), its timing (profiler.py) and process
groups (dist.py). The RL loop lives in `gearshift.rl`, locally built models in
`gearshift.models`, the reference backends in `gearshift.backends`, the
conformance suite in `gearshift.conformance`. Importing the kernel imports none
of them: `gearshift.Trainer` loads the RL loop when first read.
"""

from .hybrid import HybridActor, ModeError
from .mesh import MeshError, MeshSpec, Placement, Replicate, Shard
from .options import EngineError, OptionError, option
from .profiler import Phase, PhaseTimer, SwitchReport
from .registry import BackendError, create, list_backends, load, register
from .reshard import NaiveResharder, ReshardPlan, Resharder, StreamingResharder, plan_reshard
from .rollout import Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams
from .train import PolicyOutput, TrainArgs, TrainBatch, TrainEngine
from .weights import ParamSpec, WeightBucket, WeightError, WeightSpec

__version__ = "0.1.0"


def __getattr__(name: str):
    """`gearshift.Trainer` (the RL loop) is imported on first use: `import gearshift` loads the kernel alone."""
    if name == "Trainer":
        from .rl import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BackendError", "EngineError", "HybridActor", "OptionError", "RolloutArgs", "TrainArgs", "option", "MeshError", "MeshSpec", "ModeError", "NaiveResharder", "ParamSpec",
    "Phase", "PhaseTimer", "Placement", "PolicyOutput", "Replicate", "ReshardPlan", "Resharder", "Rollout",
    "RolloutEngine", "RolloutError", "SamplingParams", "Shard", "StreamingResharder", "SwitchReport",
    "TrainBatch", "TrainEngine", "Trainer", "WeightBucket", "WeightError", "WeightSpec", "create", "list_backends",
    "load", "plan_reshard", "register",
]
