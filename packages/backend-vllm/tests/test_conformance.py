"""The core conformance suite: the vllm rollout engine alone, and paired with the core's `torch` trainer."""

import pytest

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite
from gearshift_vllm.engine import VLLMRolloutEngine


class TestVLLMRollout(RolloutEngineSuite):
    rollout_backend = VLLMRolloutEngine  # its conformance_xfail: CPU vLLM has no sleep mode

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights


class TestTorchVLLMPair(PairSuite):
    train_backend, rollout_backend = TorchTrainEngine, VLLMRolloutEngine
    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, gearshift_model):
        return TorchTrainEngine.build(gearshift_model, lr=1e-2)

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights
