"""Starting DeepSpeed inside a gearshift process: the process group, no C++ builds, one `initialize`.

DeepSpeed JIT-compiles C++ ops with g++ (and nvcc) on first use. Two are on
the path of a plain training run and none is needed by it:

- the shared-memory all-reduce op, built whenever DeepSpeed wraps a process
  group (minutes on a CPU). It only serves `inference_all_reduce`, the
  collective of DeepSpeed's inference-time tensor parallelism; training
  reduces through torch.distributed. `import_deepspeed` turns its build off.
- the fused optimizers (FusedAdam, DeepSpeedCPUAdam), built when the config
  names an optimizer. The engine passes a torch optimizer instead unless asked.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from gearshift import dist as gdist


def import_deepspeed():
    """`import deepspeed`, with the shared-memory comm op's build switched off; returns the module."""
    import deepspeed
    import deepspeed.comm  # noqa: F401

    # `deepspeed.comm.torch` read as an attribute is the torch package (deepspeed.comm star-imports a
    # module that imports torch): the submodule is only reachable through sys.modules.
    comm = sys.modules["deepspeed.comm.torch"]
    comm.build_shm_op = _no_shm_op
    # DeepSpeed reduces and gathers through torch calls that torch 2.13 flags as deprecated, on every call
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    return deepspeed


def _no_shm_op():
    return None


def initialize(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: dict):
    """`deepspeed.initialize` over gearshift's process group; returns DeepSpeed's engine.

    The group is torchrun's, joined before the engine is built, or one of size 1 made
    here in a plain process. DeepSpeed asserts that LOCAL_RANK is set even then.
    """
    deepspeed = import_deepspeed()
    gdist.ensure_process_group()
    forget_destroyed_groups()
    os.environ.setdefault("LOCAL_RANK", "0")
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


def forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached process groups when the group they came from was destroyed behind its back.

    DeepSpeed clones the world group once and keeps the clone (and groups made from
    it) in module globals. When the world group is destroyed with torch's own
    `destroy_process_group` (a test tearing down its group, a rollout engine closing
    one), the next `initialize` would use the dead clone ("Group ... is not
    registered"). DeepSpeed's own destroy releases them; this does the same for a
    group destroyed elsewhere.
    """
    from deepspeed.utils import groups

    cached = groups._WORLD_GROUP
    if cached is None:
        return
    try:
        torch.distributed.get_process_group_ranks(cached)
    except (KeyError, ValueError, RuntimeError):  # torch no longer knows the group
        groups._release_process_group_references(None)


def release(engine) -> None:
    """Let go of a DeepSpeed engine: its hooks and buffers, and the reference ZeRO-3 keeps to its model.

    `destroy` logs through the process group, so it is skipped once the group is gone.
    ZeRO-3 pushes the model onto a module-level stack (`FWD_MODULE_STACK`) when it sets up
    its hooks and never takes it off; the model's hooks hold the engine, so without this every
    ZeRO-3 engine a process builds would stay in memory for good. Once a forward has run on a
    complete trace (a second forward: `forward_logprobs` then a train step), ZeRO-3's parameter
    coordinator also caches which parameters each module releases in an `lru_cache` on the class,
    keyed by the coordinator and the module: that cache is emptied too (every engine's; it refills).
    """
    if torch.distributed.is_initialized():
        engine.destroy()
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK[:] = [m for m in offload.FWD_MODULE_STACK if m is not engine.module]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        clear_lru_caches(vars(coordinator.PartitionedParameterCoordinator).values())


def clear_lru_caches(functions) -> int:
    """Empty the `functools.lru_cache` of each of `functions`, found on it or in its closure (DeepSpeed wraps
    its cached methods in a profiling decorator); returns how many were emptied."""
    cleared = 0
    for fn in functions:
        cells = [fn]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        for candidate in cells:
            if callable(getattr(candidate, "cache_clear", None)) and hasattr(candidate, "cache_info"):
                candidate.cache_clear()
                cleared += 1
    return cleared
