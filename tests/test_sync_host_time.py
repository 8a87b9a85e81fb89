"""A sync's host work per tensor stays small: on a model with Qwen2-0.5B's count of tensors (290) at tiny widths,
where host work dominates as it does on a GPU, a sync from fsdp (or DeepSpeed ZeRO-3) into hf takes at most a few
times one batched copy of the same tensors (`torch._foreach_copy_`), measured in the same run. A sync that unwraps
each DTensor, checks each weight's placement again or builds each slice anew on every switch takes 10x or more;
one that gathers ZeRO-3's weights through DeepSpeed's `GatheredParameters`, parameter by parameter, over 30x."""

import os
import time

import pytest
import torch

from gearshift import HybridActor, registry
from gearshift.models import resolve_model
from gearshift.reshard import StreamingResharder, export_weights

#: sync / one batched copy of the same tensors, the fastest of 30 each: for fsdp 3-4x measured alone on 2 cores, 7.7x
#: once inside the whole suite's process (10-12x before the sync's per-tensor work was done once per plan); the margin
#: is for that. ZeRO-3 makes a view of each weight's partition and looks it up on every sync: 5-11x alone, 36x through
#: DeepSpeed's GatheredParameters, so its margin for the suite's process still fails that path.
RATIO = {"fsdp": 9.0, "deepspeed": 18.0}


def _best(fn, n=30) -> float:
    """The fastest of `n` calls: its own cost, without the time other processes took the core (a session's
    Ray cluster, say), which lengthens the host-bound sync more than the memory-bound copy."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@pytest.mark.parametrize("backend, options", [("fsdp", {}), ("deepspeed", {"zero_stage": 3})],
                         ids=["fsdp", "deepspeed-zero3"])
def test_a_syncs_host_work_per_tensor_is_a_small_multiple_of_one_batched_copy(backend, options):
    if not registry.ready("train", backend):
        if os.environ.get("CI"):
            pytest.fail(f"gearshift-{backend} not installed: tools/install.sh installs it")
        pytest.skip(f"gearshift-{backend} not installed")
    path = resolve_model("deep")
    train = registry.create("train", backend, model=path, **options)
    rollout = registry.create("rollout", "hf", model=path)
    try:
        actor = HybridActor(train, rollout, StreamingResharder(share=False))
        assert len(actor.plan.dst) == 290
        rollout.wake(["weights", "kv_cache"])  # syncs into the same storage, as on a GPU between switches
        sync = lambda: actor.resharder.sync(actor.plan, train, rollout)  # noqa: E731
        for _ in range(3):
            sync()
        full = {k: v.detach().clone() for b in export_weights(train, actor.plan.dst) for k, v in b.items()}
        src, dst = list(full.values()), [torch.empty_like(v) for v in full.values()]
        sync_s, copy_s = _best(sync), _best(lambda: torch._foreach_copy_(dst, src))
        print(f"sync {sync_s * 1e3:.2f} ms, one batched copy {copy_s * 1e3:.2f} ms: {sync_s / copy_s:.1f}x, "
              f"{(sync_s - copy_s) / 290 * 1e6:.1f} us of host work per tensor")
        ratio = RATIO[backend]
        assert sync_s <= ratio * copy_s, f"sync {sync_s * 1e3:.2f} ms is over {ratio}x one batched copy"
    finally:
        train.close()
        rollout.close()
