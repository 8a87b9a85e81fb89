"""gearshift: RL post-training of LLMs with near-free switches between training and rollout.

The kernel is this package's top level: the engine interfaces (train.py,
rollout.py) and how engines are built (options.py), weights and meshes
(weights.py, mesh.py), resharding (reshard/), the registry of backends
(registry.py), the switch (hybrid.py), its timing (profiler.py) and process
groups (dist.py). The RL loop lives in `gearshift.rl`, locally built models in
`gearshift.models`, the reference backends in `gearshift.backends`, the
conformance suite in `gearshift.conformance`.
"""

from .hybrid import HybridActor, ModeError
from .mesh import MeshError, MeshSpec, Placement, Replicate, Shard
from .options import EngineError, OptionError, option
from .profiler import Phase, PhaseTimer, SwitchReport
from .registry import BackendError, create, list_backends, load, register
from .reshard import NaiveResharder, ReshardPlan, Resharder, StreamingResharder, plan_reshard
from .rl import Trainer
from .rollout import Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams
from .train import PolicyOutput, TrainArgs, TrainBatch, TrainEngine
from .weights import ParamSpec, WeightBucket, WeightError, WeightSpec

__version__ = "0.1.0"

__all__ = [
    "BackendError", "EngineError", "HybridActor", "OptionError", "RolloutArgs", "TrainArgs", "option", "MeshError", "MeshSpec", "ModeError", "NaiveResharder", "ParamSpec",
    "Phase", "PhaseTimer", "Placement", "PolicyOutput", "Replicate", "ReshardPlan", "Resharder", "Rollout",
    "RolloutEngine", "RolloutError", "SamplingParams", "Shard", "StreamingResharder", "SwitchReport",
    "TrainBatch", "TrainEngine", "Trainer", "WeightBucket", "WeightError", "WeightSpec", "create", "list_backends",
    "load", "plan_reshard", "register",
]
