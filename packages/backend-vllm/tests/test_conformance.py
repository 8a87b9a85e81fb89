"""The core conformance suite: the vllm rollout engine alone, and paired with the core's `torch` trainer."""

import pytest

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite
from gearshift_vllm.engine import VLLMRolloutEngine


class TestVLLMRollout(RolloutEngineSuite):
    expected_failures = VLLMRolloutEngine.conformance_xfail.get("rollout", {})  # CPU: no sleep mode

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights


class TestTorchVLLMPair(PairSuite):
    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        return TorchTrainEngine(gearshift_model, lr=1e-2)

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights
