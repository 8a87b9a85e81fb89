"""The core conformance suite: the vllm rollout engine alone, and paired with the core's `torch` trainer."""

import pytest
import torch

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


class TestTorchLoraVLLMAdapterPair(PairSuite):
    """A LoRA trainer beside an engine that serves adapters: every pair contract with the merged sync,
    and the adapter sync (`test_adapter_sync_serves_the_trainers_policy`)."""

    train_backend, rollout_backend = TorchTrainEngine, VLLMRolloutEngine

    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, gearshift_model):
        pytest.importorskip("peft")
        return TorchTrainEngine.build(gearshift_model, lr=1e-2, lora_r=4, lora_alpha=8)

    @pytest.fixture(scope="class")
    @classmethod
    def rollout_engine(cls, gearshift_model, vllm_cache_dir):
        if torch.cuda.is_available():  # the suite's engines are fp32 (tools/gpu/lora_h200.sh runs it in bf16)
            pytest.skip("vLLM's GPU LoRA kernels take half precision only")
        engine = VLLMRolloutEngine.build(gearshift_model, cache_dir=str(vllm_cache_dir), kv_cache_bytes=64 << 20,
                                         max_lora_rank=4)
        yield engine
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU weight layouts")
def test_serving_adapters_on_a_cpu_needs_the_plain_layout(gearshift_model):
    with pytest.raises(ValueError, match="cpu_weights='plain'"):
        VLLMRolloutEngine.build(gearshift_model, max_lora_rank=8, cpu_weights="packed")
