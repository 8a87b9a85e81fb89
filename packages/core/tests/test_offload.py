"""HostStash: storages to host memory and back bit-exactly, into one buffer kept for every later offload."""

import pytest
import torch

from gearshift.offload import HostStash


def test_host_stash_frees_the_storage_and_restores_it_bit_exactly():
    # on a GPU engines hand it device tensors; here host tensors exercise the same steps
    a = torch.randn(1000)
    flat = torch.randn(600)
    grads = [flat[:200].view(10, 20), flat[200:]]  # two views of one storage, as FSDP's gradients are
    keep = [a.clone(), flat.clone()]
    ids = [id(a), id(grads[0]), id(grads[1])]
    stash = HostStash()
    assert stash.offload([a, *grads]) == a.nbytes + flat.nbytes  # the shared storage moves once
    assert a.untyped_storage().nbytes() == 0 and flat.untyped_storage().nbytes() == 0
    assert stash.restore() == a.nbytes + flat.nbytes
    assert torch.equal(a, keep[0]) and torch.equal(flat, keep[1])
    assert torch.equal(grads[0], keep[1][:200].view(10, 20)) and torch.equal(grads[1], keep[1][200:])
    assert [id(a), id(grads[0]), id(grads[1])] == ids and len(stash) == 0


def test_the_host_buffer_is_allocated_once_at_the_size_it_holds():
    tensors = [torch.randn(1000), torch.randn(37, 3)]
    need = sum(t.nbytes for t in tensors)
    stash = HostStash()
    stash.reserve(need)
    buffer = stash._buffer.data_ptr()
    assert need <= stash.host_bytes <= need + 64 * len(tensors)  # aligned starts only
    for _ in range(3):
        keep = [t.clone() for t in tensors]
        stash.offload(tensors)
        assert stash._buffer.data_ptr() == buffer  # reused, not reallocated
        stash.restore()
        assert all(torch.equal(t, k) for t, k in zip(tensors, keep))
    with pytest.raises(RuntimeError, match="restore"):
        stash.offload(tensors)
        stash.offload(tensors)
    stash.restore()
    stash.close()
    assert stash.host_bytes == 0


def test_host_memory_that_cannot_be_page_locked_is_named_in_a_warning(monkeypatch):
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(
        cudaHostRegister=lambda ptr, n, flags: calls.append(n) or 2))  # cudaErrorMemoryAllocation
    stash = HostStash()
    with pytest.warns(RuntimeWarning, match="could not page-lock .* error 2"):
        stash.reserve(1 << 20)
    assert calls and not stash.pinned
    t = torch.randn(100)
    keep = t.clone()
    stash.offload([t])  # still works, through plain host memory
    stash.restore()
    assert torch.equal(t, keep)


def test_the_memory_plan_moves_only_what_the_rollout_engine_needs_largest_first():
    from gearshift.memory import GiB, plan_offload

    sizes = {"params": 2 * GiB, "grads": 2 * GiB, "optimizer": 4 * GiB}
    fits = plan_offload(need=3 * GiB, free=10 * GiB, sizes=sizes)
    assert fits.tags == () and "kept" in fits.note
    one = plan_offload(need=6 * GiB, free=3 * GiB, sizes=sizes)
    assert one.tags == ("optimizer",) and "moved ['optimizer']" in one.note
    two = plan_offload(need=8 * GiB, free=3 * GiB, sizes=sizes)  # with the margin: 8.8 GiB
    assert two.tags == ("optimizer", "params") or two.tags == ("optimizer", "grads")
    short = plan_offload(need=100 * GiB, free=1 * GiB, sizes=sizes)
    assert len(short.tags) == 3 and "still short" in short.note


def test_on_a_cpu_nothing_is_offloaded_and_the_report_says_why(gearshift_model):
    from gearshift import HybridActor
    from gearshift.backends.hf_rollout import HFRolloutEngine
    from gearshift.backends.torch_train import TorchTrainEngine

    actor = HybridActor(TorchTrainEngine.build(gearshift_model), HFRolloutEngine.build(gearshift_model))
    report = actor.to_rollout()
    assert report.phase("offload") is None
    assert any("host memory already" in n for n in report.notes) and "note:" in report.table()
    actor.to_train()
    forced = HybridActor(actor.train, actor.rollout, offload=["optimizer", "grads"])
    assert forced.to_rollout().phase("offload").bytes == 0  # asked for: done, and nothing to move on a CPU
    forced.to_train()
