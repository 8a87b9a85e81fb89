"""The core conformance suite: the sglang rollout engine alone, and paired with the `torch`, `fsdp` and `deepspeed`
trainers (ZeRO-3: each bucket gathered while it is sent)."""

import os

import pytest

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance import PairSuite, RolloutEngineSuite
from gearshift_sglang.engine import SGLangRolloutEngine

try:
    from gearshift_fsdp.engine import FSDPTrainEngine
except ImportError:  # the fsdp backend is not installed here: its pair is skipped
    FSDPTrainEngine = None
try:
    from gearshift_deepspeed.engine import DeepSpeedTrainEngine
except ImportError:  # the deepspeed backend is not installed here: its pair is skipped
    DeepSpeedTrainEngine = None


class TestSGLangRollout(RolloutEngineSuite):
    rollout_backend = SGLangRolloutEngine  # its conformance_xfail: CPU SGLang releases nothing

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights


class TestTorchSGLangPair(PairSuite):
    train_backend, rollout_backend = TorchTrainEngine, SGLangRolloutEngine

    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        return TorchTrainEngine.build(gearshift_model, lr=1e-2)

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights


@pytest.mark.skipif(FSDPTrainEngine is None, reason="gearshift-fsdp is not installed")
class TestFSDPSGLangPair(PairSuite):
    train_backend, rollout_backend = FSDPTrainEngine, SGLangRolloutEngine

    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        return FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32")

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights


@pytest.mark.skipif(DeepSpeedTrainEngine is None, reason="gearshift-deepspeed is not installed")
class TestDeepSpeedSGLangPair(PairSuite):
    train_backend, rollout_backend = DeepSpeedTrainEngine, SGLangRolloutEngine

    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        had_local_rank = "LOCAL_RANK" in os.environ
        engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3)
        yield engine
        engine.close()
        if not had_local_rank:  # DeepSpeed needs LOCAL_RANK for an engine's life, set to 0 in a plain process
            os.environ.pop("LOCAL_RANK", None)  # test_engine.py checks what SGLang alone leaves in the environment

    @pytest.fixture
    def rollout_engine(self, serving_model_weights):
        return serving_model_weights
