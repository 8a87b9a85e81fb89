"""Keeping vLLM's process-wide side effects out of the trainer that shares the process.

Importing vLLM and starting an engine change global state that belongs to the
host: torch's thread count (and `torch.set_num_threads`, which the CPU worker
replaces with a no-op), the random generators (the worker seeds them), and
environment variables that other code reads (`LOCAL_WORLD_SIZE`, `LD_PRELOAD`,
`TORCHINDUCTOR_*`). `HostState` records them before and puts them back after.
Its caches, sockets and temporary files go under one folder (`cache_paths`).
"""

from __future__ import annotations

import os
import random
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

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


@dataclass
class RngState:
    """The global generators vLLM draws from or reseeds: torch (CPU and CUDA), `random`, numpy."""

    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None
    python: tuple
    numpy: tuple | None

    @classmethod
    def capture(cls) -> "RngState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, random.getstate(), _numpy_state())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)

    @classmethod
    def seeded(cls, seed: int) -> "RngState":
        """A fresh state for the engine's own draws, so unseeded sampling never touches the host's."""
        outer = cls.capture()
        try:
            torch.manual_seed(seed)
            random.seed(seed)
            return cls.capture()
        finally:
            outer.restore()


def _numpy_state():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


@dataclass
class HostState:
    """What vLLM changes in the host process, recorded so it can be put back."""

    threads: int
    set_num_threads: object
    matmul_precision: str  # vLLM's GPU worker sets torch.set_float32_matmul_precision for the process
    environ: dict[str, str]
    rng: RngState
    tempdir: str | None
    changed_env: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> "HostState":
        return cls(torch.get_num_threads(), torch.set_num_threads, torch.get_float32_matmul_precision(),
                   dict(os.environ), RngState.capture(), tempfile.tempdir)

    def restore(self) -> None:
        """Put back threads, `torch.set_num_threads`, matmul precision, the generators, `tempfile.tempdir`
        and non-vLLM variables."""
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)
        torch.set_float32_matmul_precision(self.matmul_precision)
        self.rng.restore()
        tempfile.tempdir = self.tempdir
        for key in set(os.environ) | set(self.environ):
            if key.startswith(OWN_PREFIX):
                continue
            before, now = self.environ.get(key), os.environ.get(key)
            if before == now:
                continue
            self.changed_env[key] = (before, now)
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before


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
    """Run vLLM (its import, start-up, or a call) with `env` set and the host's state put back afterwards.

    The variables in `env` that start with VLLM_ stay set (vLLM reads them
    later); the others (TORCHINDUCTOR_CACHE_DIR) only last for the block.
    """
    state = HostState.capture()
    os.environ.update(env)
    if tmp is not None:
        tempfile.tempdir = str(tmp)  # vLLM's rendezvous file for a one-process group goes to gettempdir()
    try:
        yield state
    finally:
        state.restore()


def default_threads() -> int:
    """vLLM's own choice for its steady-state work: OMP_NUM_THREADS when set, else one thread."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return 1


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch threads (None: as they are), then put the host's count back."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
