"""vLLM's process groups, which are the process's: shared by its engines, outliving or dying before them.

vLLM keeps its group objects (`parallel_state._WORLD`, `_TP`, ...) in module
globals. Under `external_launcher` it builds them on the default process group
torchrun made; in a single process with none yet, it makes the default group
itself. This module keeps the engines of the process that still run on them
(`LIVE`), forgets groups that died with the default one, and shuts an engine
down without tearing down groups that others still use.
"""

from __future__ import annotations

import weakref

import torch

#: the engines of this process that are running: vLLM's process groups are the process's, shared by them all
LIVE: weakref.WeakSet = weakref.WeakSet()


def forget_dead_groups(parallel_state) -> bool:
    """Drop vLLM's process groups if they died with the default group; True if they did (or there are none).

    `destroy_process_group()` ends every group of the process, vLLM's included (a test's teardown, a
    trainer closing a group it made); vLLM keeps its group objects in module globals and fails on the
    dead ones when the next engine starts ("Invalid process group specified"), or when it tears down.
    Forgotten, they are made again by the next engine.
    """
    world = parallel_state._WORLD
    if world is None:
        return True
    if torch.distributed.is_initialized():
        try:
            torch.distributed.get_backend(world.device_group)
            return False
        except (ValueError, RuntimeError):
            pass
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)
    return True


def default_group_if_made_by(start):
    """Run `start()` (vLLM's start); returns what it made and the default process group if `start` made it."""
    made_default = not torch.distributed.is_initialized()
    made = start()
    return made, (torch.distributed.group.WORLD if made_default else None)


def release_groups(parallel_state, default_group) -> None:
    """Destroy vLLM's own groups, its world group too (a later engine would otherwise find it stale once the
    default group is remade), unless another engine of this process still runs on them. The default
    process group goes only if vLLM made it (`default_group`) and it is still that one: other engines
    of this process use a group someone else made."""
    if forget_dead_groups(parallel_state) or len(LIVE):
        return
    parallel_state.destroy_model_parallel()
    if default_group is not None and torch.distributed.is_initialized() \
            and torch.distributed.group.WORLD is default_group:
        parallel_state.destroy_distributed_environment()
    elif parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None


def shut_down(engine, llm, default_group) -> None:
    """Shut down `llm` (the `vllm.LLM` of `engine`), releasing only the groups no other engine runs on.

    The in-process engine core's shutdown (run now, or by a finalizer whenever the engine is
    collected) ends with vLLM's `cleanup_dist_env_and_memory`, which destroys the default process
    group too: it is shut down here with that cleanup limited to vLLM's own groups (`release_groups`).
    """
    import vllm.v1.engine.core as engine_core
    from vllm.distributed import parallel_state

    LIVE.discard(engine)

    def release() -> None:
        release_groups(parallel_state, default_group)

    client = llm.llm_engine.engine_core
    cleanup = engine_core.cleanup_dist_env_and_memory
    engine_core.cleanup_dist_env_and_memory = release
    try:
        client.shutdown()
    finally:
        engine_core.cleanup_dist_env_and_memory = cleanup
    release()
