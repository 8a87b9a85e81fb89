"""The core's conformance suite on the fsdp backend, paired with the core's `hf` rollout engine.

Runs in one process here, and with two under torchrun from test_two_processes.py.
"""

import json
import os

import pytest
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite, TrainEngineSuite

from gearshift_fsdp.engine import FSDPTrainEngine

# the suite compares with fp32 references (on a GPU the default computes in bf16); FSDP2 even on one rank (where
# the default trains the module as it is: TestFSDPTrainOnOneRank); a launcher may add options
OPTIONS = {"param_dtype": "float32", "one_rank": "fsdp", **json.loads(os.environ.get("GEARSHIFT_FSDP_OPTIONS", "{}"))}
#: the rollout engine's mesh, set by a launcher (tp=2: each rank keeps its slice); default dp over every rank
ROLLOUT_MESH = os.environ.get("GEARSHIFT_HF_MESH") or None


class TestFSDPTrain(TrainEngineSuite):
    train_backend = FSDPTrainEngine
    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: FSDPTrainEngine.build(gearshift_model, **{**OPTIONS, **kw})


if os.environ.get("WORLD_SIZE", "1") == "1":  # one process: the default, the module as it is
    class TestFSDPTrainOnOneRank(TrainEngineSuite):
        train_backend = FSDPTrainEngine
        @pytest.fixture
        def train_engine_factory(self, gearshift_model):
            return lambda **kw: FSDPTrainEngine.build(gearshift_model, **{"param_dtype": "float32", **kw})


class TestFSDPWithHFRollout(PairSuite):
    train_backend, rollout_backend = FSDPTrainEngine, HFRolloutEngine
    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, gearshift_model):
        return FSDPTrainEngine.build(gearshift_model, lr=1e-2, **OPTIONS)

    @pytest.fixture(scope="class")
    @classmethod
    def rollout_engine(cls, gearshift_model):
        return HFRolloutEngine.build(gearshift_model, mesh=ROLLOUT_MESH)


if ROLLOUT_MESH:  # the rollout engine on the launcher's layout (tp=2: a tensor-parallel hf engine) keeps its contract
    class TestHFRolloutOnTheLaunchMesh(RolloutEngineSuite):
        rollout_backend = HFRolloutEngine
        @pytest.fixture(scope="class")
        @classmethod
        def rollout_engine(cls, gearshift_model):
            return HFRolloutEngine.build(gearshift_model, mesh=ROLLOUT_MESH)
