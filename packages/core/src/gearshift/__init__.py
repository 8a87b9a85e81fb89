"""gearshift: RL post-training of LLMs with near-free switches between training and rollout."""

from .hybrid import HybridActor, ModeError
from .mesh import MeshError, MeshSpec, Placement, Replicate, Shard
from .profiler import Phase, PhaseTimer, SwitchReport
from .registry import BackendError, create, list_backends, load, register
from .reshard import NaiveResharder, ReshardPlan, Resharder, StreamingResharder, plan_reshard
from .run import Trainer
from .rollout import Rollout, RolloutEngine, RolloutError, SamplingParams
from .train import PolicyOutput, TrainBatch, TrainEngine
from .weights import ParamSpec, WeightBucket, WeightError, WeightSpec

__version__ = "0.1.0"

__all__ = [
    "BackendError", "HybridActor", "MeshError", "MeshSpec", "ModeError", "NaiveResharder", "ParamSpec",
    "Phase", "PhaseTimer", "Placement", "PolicyOutput", "Replicate", "ReshardPlan", "Resharder", "Rollout",
    "RolloutEngine", "RolloutError", "SamplingParams", "Shard", "StreamingResharder", "SwitchReport",
    "TrainBatch", "TrainEngine", "Trainer", "WeightBucket", "WeightError", "WeightSpec", "create", "list_backends",
    "load", "plan_reshard", "register",
]
