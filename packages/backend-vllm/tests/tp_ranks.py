"""Run on every rank under torchrun by test_tp_slices.py: a vLLM engine of tp=2 declaring each rank's slices.

The rollout suite on it, the pair suite with an fsdp trainer over dp=2 (FSDP's
dim-0 shards into vLLM's tensor-parallel slices: every weight is cut another
way), and what each rank receives and then holds.
"""

import math

import pytest
import torch

from gearshift import dist as gdist
from gearshift.conformance import PairSuite, RolloutEngineSuite
from gearshift.conformance.util import as_buckets, reference_weights
from gearshift.hybrid import HybridActor
from gearshift.mesh import box_slices
from gearshift.reshard import plan_reshard
from gearshift_vllm.engine import VLLMRolloutEngine
from gearshift_vllm.tp_slices import RankBoxes


@pytest.fixture(scope="session")
def vllm_tp(gearshift_model, vllm_cache_dir):
    engine = VLLMRolloutEngine.build(gearshift_model, mesh="tp=2", cache_dir=str(vllm_cache_dir),
                                     kv_cache_bytes=64 << 20)
    yield engine
    engine.close()


@pytest.fixture
def serving(vllm_tp, gearshift_model):
    yield vllm_tp
    vllm_tp.wake(["weights", "kv_cache"])
    vllm_tp.update_weights(as_buckets(reference_weights(gearshift_model, vllm_tp.weight_spec()), vllm_tp.device))


@pytest.fixture(scope="session")
def fsdp_dp2(gearshift_model):
    fsdp = pytest.importorskip("gearshift_fsdp.engine")
    return fsdp.FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32", mesh="dp=2")


class TestVLLMTensorParallelRollout(RolloutEngineSuite):
    rollout_backend = VLLMRolloutEngine

    @pytest.fixture
    def rollout_engine(self, serving):
        return serving


class TestFSDPIntoVLLMTensorParallel(PairSuite):
    rollout_backend = VLLMRolloutEngine

    @pytest.fixture
    def train_engine(self, fsdp_dp2):
        return fsdp_dp2

    @pytest.fixture
    def rollout_engine(self, serving):
        return serving


def local_bytes(spec, rank: int) -> int:
    return sum(p.dtype.itemsize * math.prod(p.placement.local_shape(p.shape, rank)) for p in spec)


def test_the_tensor_parallel_weights_are_declared_as_slices(vllm_tp, fsdp_dp2):
    spec, rank = vllm_tp.weight_spec(), gdist.rank()
    sliced = {p.name for p in spec if isinstance(p.placement, RankBoxes)}
    for suffix in ("q_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   "embed_tokens.weight"):
        assert any(n.endswith(suffix) for n in sliced), suffix
    assert not any("norm" in n for n in sliced)  # whole on every rank, as vLLM keeps them
    sliced_plan = plan_reshard(fsdp_dp2.weight_spec(), spec)
    whole_plan = plan_reshard(fsdp_dp2.weight_spec(), spec.replicated())  # what the engine declared before
    got, whole = sliced_plan.bytes_received(rank), whole_plan.bytes_received(rank)
    print(f"FIGURE rank {rank}: receives {got} bytes of {whole} ({got / whole:.3f}) with tp=2 slices declared")
    assert got == local_bytes(spec, rank) < 0.6 * whole


def test_after_a_sync_each_rank_holds_exactly_its_slice(serving, fsdp_dp2):
    from gearshift.conformance.train import fixed_batch, full_weights, nll

    fsdp_dp2.train_step(fixed_batch(), nll)
    full = full_weights(fsdp_dp2)
    actor = HybridActor(fsdp_dp2, serving)
    report = actor.to_rollout()
    actor.to_train()
    rank = gdist.rank()
    assert report.phase("load").bytes == actor.plan.bytes_received(rank) == local_bytes(serving.weight_spec(), rank)
    storages = serving._llm.collective_rpc(_storages)[0]  # where vLLM's own parameters live
    for p in serving.weight_spec():
        if isinstance(p.placement, RankBoxes):
            want = full[p.name][box_slices(p.placement.local_box(p.shape, rank))]
            view = serving._landing[p.name]
            assert view.untyped_storage().data_ptr() in storages, f"{p.name} is not written into vLLM's storage"
            assert torch.equal(view, want), p.name


def _storages(worker) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in worker.model_runner.model.parameters()}
