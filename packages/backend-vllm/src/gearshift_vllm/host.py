"""Keeping vLLM's process-wide side effects out of the trainer that shares the process.

Importing vLLM and starting an engine change global state that belongs to the
host: torch's thread count (and `torch.set_num_threads`, which the CPU worker
replaces with a no-op), the random generators (the worker seeds them), and
environment variables that other code reads (`LOCAL_WORLD_SIZE`, `LD_PRELOAD`,
`TORCHINDUCTOR_*`). The core's containment (`gearshift.containment`: `HostState`,
`RngState`) records them before and puts them back after; this module says
what is vLLM's own. Its caches, sockets and temporary files go under one folder (`cache_paths`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gearshift import containment
from gearshift.containment import HostState, RngState, threads

#: vLLM's own variables stay as vLLM left them: only vLLM reads them, and it reads some after start-up
OWN_PREFIX = "VLLM_"


def default_cache_dir() -> Path:
    return Path(os.environ.get("GEARSHIFT_CACHE", Path.home() / ".cache" / "gearshift")) / "vllm"


def cache_paths(root: str | os.PathLike) -> dict[str, Path]:
    """Where vLLM's files go under `root`: caches, IPC sockets, compiled kernels, temporary files."""
    root = Path(root)
    return {"cache": root / "cache", "rpc": root / "rpc", "inductor": root / "inductor", "tmp": root / "tmp"}


def engine_environment(root: str | os.PathLike, kv_cache_gib: int | None = None) -> dict[str, str]:
    """The variables vLLM must see before it is imported: in-process engine, files under `root`."""
    paths = cache_paths(root)
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)  # vLLM binds IPC sockets there without creating the folder
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine must live in this process to take tensors
        "VLLM_CACHE_ROOT": str(paths["cache"]),
        "VLLM_RPC_BASE_PATH": str(paths["rpc"]),
        "VLLM_ASSETS_CACHE": str(paths["cache"] / "assets"),
        "TORCHINDUCTOR_CACHE_DIR": str(paths["inductor"]),
        # every weight reload logs several lines at INFO and WARNING: noise in an RL run's console
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
    }
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def call_environment(root: str | os.PathLike, exact_fp32: bool) -> dict[str, str]:
    """What vLLM needs set while it runs, beyond what it set itself at start-up.

    Its sampler compiles small kernels with inductor on first use (they go under `root`).
    `exact_fp32`: Triton turns fp32 dot products into TF32 unless told otherwise, which
    puts the GPU attention kernels' logprobs ~1e-4 away from the trainer's.
    """
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_paths(root)["inductor"])}
    if exact_fp32 and "TRITON_F32_DEFAULT" not in os.environ:
        env["TRITON_F32_DEFAULT"] = "ieee"
    return env


@contextmanager
def contained(env: dict[str, str], tmp: str | os.PathLike | None = None) -> Iterator[HostState]:
    """Run vLLM (its import, start-up, or a call) with `env` set and the host's state put back afterwards
    (`gearshift.containment`); vLLM's own variables (VLLM_*) stay set, since vLLM reads them later."""
    with containment.contained(env, tmp, keep=OWN_PREFIX) as state:
        yield state


def default_threads() -> int:
    """vLLM's own choice for its steady-state work: OMP_NUM_THREADS when set, else one thread."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return 1


def generate_threads() -> int:
    """Torch threads for generating on a CPU when none are asked for: OMP_NUM_THREADS when set, else every core
    this process may run on. A colocated trainer waits while the engine generates, so its cores are free."""
    if "OMP_NUM_THREADS" in os.environ:
        return default_threads()
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


__all__ = ["HostState", "OWN_PREFIX", "RngState", "cache_paths", "call_environment", "contained", "default_cache_dir",
           "default_threads", "engine_environment", "generate_threads", "threads"]
