"""The reference backends (`torch` train, `hf` rollout) through the conformance suite."""

import pytest

from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite, TrainEngineSuite


@pytest.fixture(scope="module")
def hf_engine(gearshift_model):
    return HFRolloutEngine(gearshift_model)


class TestHFRollout(RolloutEngineSuite):
    @pytest.fixture
    def rollout_engine(self, hf_engine):
        return hf_engine


class TestTorchTrain(TrainEngineSuite):
    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: TorchTrainEngine(gearshift_model, **kw)


class TestTorchHFPair(PairSuite):
    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        return TorchTrainEngine(gearshift_model, lr=1e-2)

    @pytest.fixture
    def rollout_engine(self, hf_engine):
        return hf_engine
