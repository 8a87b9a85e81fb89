"""Keeping an in-process engine's process-wide side effects out of the trainer that shares the process.

A rollout engine that lives in the training process (vLLM, SGLang's `Engine`)
changes, when it is imported, started or called, global state that belongs to
the host: environment variables other code reads, torch's thread count (and
`torch.set_num_threads`, which vLLM's CPU worker replaces with a no-op), the
float32 matmul precision, the random generators (engines seed them), signal
handlers, the multiprocessing start method, resource limits, the root logger,
asyncio's event loop policy and `tempfile.tempdir`.

`contained(env, tmp, keep=PREFIX)` records all of it (`HostState`) before a
block that calls into the engine and puts it back after; the engine's own
variables (those starting with `keep`) stay as it left them, since it reads
some of them later. `RngState` is the generators alone, for an engine that
draws from generators of its own (`RngState.seeded`). `heap_frozen` keeps the
objects alive at its start out of the garbage collector's reach for a block, as
vLLM does from its engine's start, where an engine that does not (SGLang's host
side) leaves the trainer's process hundreds of thousands of objects to walk at
every full collection.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import random
import resource
import signal
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

#: signal handlers an engine may take over (SGLang's event loop takes SIGTERM)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
#: resource limits an engine may raise (the stack, open files)
LIMITS = (resource.RLIMIT_STACK, resource.RLIMIT_NOFILE)


@dataclass
class RngState:
    """The global generators engines draw from or reseed: torch (CPU and CUDA), `random`, numpy."""

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
    """What an in-process engine changes in the host process, recorded so it can be put back."""

    environ: dict[str, str]
    keep: str  # the prefix of the engine's own variables: left as the engine set them
    threads: int
    set_num_threads: object
    matmul_precision: str
    rng: RngState
    tempdir: str | None
    handlers: dict
    start_method: str | None
    limits: dict
    root_handlers: list
    root_level: int
    loop_policy: asyncio.AbstractEventLoopPolicy
    #: variable -> (the host's value, the engine's), for each variable put back; None: unset
    changed_env: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    @classmethod
    def capture(cls, keep: str) -> "HostState":
        root = logging.getLogger()
        return cls(dict(os.environ), keep, torch.get_num_threads(), torch.set_num_threads,
                   torch.get_float32_matmul_precision(), RngState.capture(), tempfile.tempdir,
                   {s: signal.getsignal(s) for s in SIGNALS}, multiprocessing.get_start_method(allow_none=True),
                   {r: resource.getrlimit(r) for r in LIMITS}, list(root.handlers), root.level,
                   asyncio.get_event_loop_policy())

    def restore(self) -> None:
        """Put back everything captured; the engine's own variables (`keep`) stay."""
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)
        torch.set_float32_matmul_precision(self.matmul_precision)
        self.rng.restore()
        tempfile.tempdir = self.tempdir
        self._restore_process()
        root = logging.getLogger()
        root.handlers[:] = self.root_handlers
        if root.level != self.root_level:  # setLevel clears every logger's cache: 1.6 ms beside SGLang's loggers
            root.setLevel(self.root_level)
        asyncio.set_event_loop_policy(self.loop_policy)
        self._restore_environ()

    def _restore_process(self) -> None:
        for s, handler in self.handlers.items():
            if signal.getsignal(s) is not handler and handler is not None:
                signal.signal(s, handler)
        if multiprocessing.get_start_method(allow_none=True) != self.start_method:
            multiprocessing.set_start_method(self.start_method, force=True)
        for r, limit in self.limits.items():
            if resource.getrlimit(r) != limit:
                try:
                    resource.setrlimit(r, limit)
                except (ValueError, OSError):  # a hard limit lowered: it cannot be raised again
                    pass

    def _restore_environ(self) -> None:
        for key in set(os.environ) | set(self.environ):
            if self.keep and key.startswith(self.keep):
                continue
            before, now = self.environ.get(key), os.environ.get(key)
            if before == now:
                continue
            self.changed_env[key] = (before, now)
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before


@contextmanager
def contained(env: dict[str, str], tmp: str | os.PathLike | None = None, *, keep: str,
              loop_policy: asyncio.AbstractEventLoopPolicy | None = None) -> Iterator[HostState]:
    """Run a block that calls into an engine (its import, start-up, or a call) with `env` set, `tmp` as
    `tempfile.tempdir` and `loop_policy` as asyncio's, the host's state put back afterwards.

    The variables that start with `keep` (the engine's own: VLLM_, SGLANG_) stay as they were left;
    the others in `env` only last for the block. The yielded `HostState` says, once the block ends,
    which variables the engine had changed (`changed_env`).
    """
    state = HostState.capture(keep)
    os.environ.update(env)
    if tmp is not None:
        tempfile.tempdir = str(tmp)  # sockets and rendezvous files an engine makes under gettempdir()
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)
    try:
        yield state
    finally:
        state.restore()


@contextmanager
def heap_frozen(on: bool = True, collect: bool = False) -> Iterator[None]:
    """With `on`, the objects alive now are out of the garbage collector's reach for the block (`gc.freeze`).

    A full collection, Python's own or one a library runs (DeepSpeed's ZeRO-3 `offload_states` ends in one),
    walks every object of the process: 0.15-0.3 s on a 2-core CPU for a trainer's 470,000, 0.4-0.6 s beside
    SGLang's host side (750,000). Frozen, it walks only what the block made. `collect`: collect first, so that
    the garbage already there is not frozen with the rest. Where the heap is frozen already (vLLM freezes it when
    its engine starts, and gives it back when the engine closes) nothing is done: `gc.unfreeze` would give back
    every frozen object, not only these. A frozen object that becomes garbage in a cycle stays until the block
    ends.
    """
    if not on or gc.get_freeze_count():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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


__all__ = ["HostState", "RngState", "contained", "heap_frozen", "threads"]
