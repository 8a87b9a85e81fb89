"""The deepspeed trainer beside vLLM: a `save_hf` folder serves in vLLM, and the pair passes the conformance suite.

One vLLM engine for the module (a start costs 10-70 s on a CPU): it is built from
a folder the trainer wrote after a step, so it serves those weights before any
sync; the pair suite then syncs into it.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch
from gearshift.conformance import PairSuite
from gearshift.conformance.train import fixed_batch, nll
from gearshift.conformance.util import PROMPTS
from gearshift.rollout import SamplingParams
from gearshift.train import TrainBatch

from gearshift_deepspeed.engine import DeepSpeedTrainEngine

vllm_backend = pytest.importorskip("gearshift_vllm.engine", reason="gearshift-vllm is not installed")
VLLMRolloutEngine = vllm_backend.VLLMRolloutEngine


@pytest.fixture(scope="module")
def trained_folder(gearshift_model, gearshift_shared_tmp_root):
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, param_dtype="float32")
    engine.train_step(fixed_batch(), nll)
    path = gearshift_shared_tmp_root / "deepspeed-saved"
    engine.save_hf(str(path))
    yield engine, str(path)
    engine.close()


@pytest.fixture(scope="module")
def vllm_engine(trained_folder):
    cache = Path(os.environ.get("GEARSHIFT_VLLM_TEST_CACHE", Path(tempfile.gettempdir()) /
                                f"gearshift-vllm-test-{os.getuid()}"))
    cache.mkdir(parents=True, exist_ok=True)
    engine = VLLMRolloutEngine.build(trained_folder[1], cache_dir=str(cache), kv_cache_bytes=64 << 20)
    yield engine
    engine.close()


def test_a_saved_folder_serves_in_vllm(trained_folder, vllm_engine):
    trainer, _ = trained_folder
    rollouts = vllm_engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    batch = TrainBatch.from_sequences([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    mine = trainer.forward_logprobs(batch).logprobs
    diff = max(float((mine[i, len(r.prompt_ids):len(r.prompt_ids) + len(r.token_ids)] -
                      torch.tensor(r.logprobs)).abs().max()) for i, r in enumerate(rollouts))
    print(f"FIGURE vLLM serving a save_hf folder vs the trainer's logprobs: max abs diff {diff:.3g}")
    assert diff <= 1e-4


class TestZero3WithVLLMRollout(PairSuite):
    train_backend, rollout_backend = DeepSpeedTrainEngine, VLLMRolloutEngine

    @pytest.fixture(scope="class")
    def train_engine(self, trained_folder):
        return trained_folder[0]

    @pytest.fixture
    def rollout_engine(self, vllm_engine):
        return vllm_engine
