"""The core's conformance suite on the deepspeed backend at ZeRO stage 1, 2 and 3, paired with the `hf` rollout engine.

Runs in one process here, and with two under torchrun from test_two_processes.py.
At stages 1 and 2 every rank holds the weights whole, and the hf engine may serve
from them (in one process, fp32 on a CPU, the pair shares); at stage 3 every sync
gathers them bucket by bucket and copies.
"""

import json
import os

import pytest
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.conformance import PairSuite, TrainEngineSuite

from gearshift_deepspeed.engine import DeepSpeedTrainEngine

# the suite compares with fp32 references (on a GPU the default computes in bf16); a launcher may add options
OPTIONS = {"param_dtype": "float32", **json.loads(os.environ.get("GEARSHIFT_DEEPSPEED_OPTIONS", "{}"))}


class DeepSpeedTrainSuite(TrainEngineSuite):
    train_backend = DeepSpeedTrainEngine
    zero_stage = 3

    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: DeepSpeedTrainEngine.build(gearshift_model, **{"zero_stage": self.zero_stage, **OPTIONS, **kw})


class TestZero1Train(DeepSpeedTrainSuite):
    zero_stage = 1


class TestZero2Train(DeepSpeedTrainSuite):
    zero_stage = 2


class TestZero3Train(DeepSpeedTrainSuite):
    zero_stage = 3


class DeepSpeedHFPairSuite(PairSuite):
    train_backend, rollout_backend = DeepSpeedTrainEngine, HFRolloutEngine
    zero_stage = 3

    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, **{"zero_stage": self.zero_stage, **OPTIONS})
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def rollout_engine(self, gearshift_model):
        return HFRolloutEngine.build(gearshift_model)


class TestZero2WithHFRollout(DeepSpeedHFPairSuite):
    zero_stage = 2


class TestZero3WithHFRollout(DeepSpeedHFPairSuite):
    zero_stage = 3
