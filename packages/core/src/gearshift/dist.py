"""Process-group helpers: rank and world size that work without torch.distributed, and hang dumps."""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("GEARSHIFT_DIST_TIMEOUT", "600"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group torchrun describes (no-op for a single plain process).

    Collectives get a timeout, and a rank that is still waiting after it dumps
    every thread's stack to stderr, so a hang names where each rank stood.
    """
    if is_distributed() or "WORLD_SIZE" not in os.environ:
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _hold_the_exit_for_collective_threads()
    global _watchdog_s, _joined
    _watchdog_s = timeout_s + 30
    _joined = dist.group.WORLD
    heartbeat()


_watchdog_s: float | None = None
_joined = None  # the group `init` joined, which `leave` takes down
_left = False  # whether `leave` took it down


def leave() -> None:
    """Take down the group `init` joined, once a command has ended well on this rank.

    Not called on failure: taking a group down while a peer is still inside a
    collective can hang. `destroy_process_group` does not stop gloo's worker
    threads while anything still holds the group (an FSDP module's device mesh
    does, until the interpreter's teardown collects it), so a rank that left
    ends with `exit_now`, not through that teardown.
    """
    global _joined, _left
    if _joined is not None and is_distributed() and dist.group.WORLD is _joined:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
        _left = True
    _joined = None


def has_left() -> bool:
    """Whether `leave` took down a group this process joined (a torchrun rank whose command ended well)."""
    return _left


def exit_now(code: int) -> NoReturn:
    """End this process with `code` without the interpreter's teardown: exit handlers run, threads that
    are not daemons are joined and output is flushed first.

    A gloo worker thread that drops its last finished work during the teardown
    releases Python tensors, needs the GIL that the teardown no longer hands
    out, and aborts the process ("terminate called without an active
    exception", exit -6 after a run that went well; seen on a busy 2-core
    machine in 3 of 14 two-rank runs).
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream or a reader gone: nothing left to say
            pass
    os._exit(code)


EXIT_GRACE_S = 0.25
_grace_held = False


def _hold_the_exit_for_collective_threads() -> None:
    """At exit, before the interpreter's teardown, wait `EXIT_GRACE_S` with the GIL free (once per process).

    A gloo worker thread drops the work it ran after the rank that waited on it
    has moved on; the work's tensors are Python's, so dropping them takes the
    GIL. One that does so during the teardown, which hands the GIL to no other
    thread, aborts the process ("terminate called without an active
    exception", exit -6 after a run that went well). Exit handlers run before
    the teardown, so one that sleeps lets such a thread finish. `exit_now`
    (the CLI's way out) skips the teardown altogether; this covers every other
    script that joins or makes a group through gearshift.
    """
    global _grace_held
    if not _grace_held:
        atexit.register(time.sleep, EXIT_GRACE_S)
        _grace_held = True


def heartbeat() -> None:
    """Re-arm the hang watchdog: a rank that makes no progress for the collective timeout dumps its stacks.

    The RL loop calls this every step and every switch, so only a rank that is
    stuck (in a collective, usually) dumps, and it does so once per timeout.
    """
    if _watchdog_s is not None:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(_watchdog_s, repeat=False, file=sys.stderr, exit=False)


def broadcast_object(value, src: int = 0):
    """`value` as rank `src` has it, on every rank (itself without a process group)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(value) -> list:
    """Every rank's `value`, in rank order (`[value]` without a process group)."""
    if not is_distributed():
        return [value]
    out = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_ranks(flag: bool) -> bool:
    """True when `flag` is true on every rank (itself without a process group)."""
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def collective_device() -> torch.device:
    """Where tensors for collectives must live: the GPU under NCCL, the CPU under gloo."""
    if is_distributed() and dist.get_backend() == "nccl":
        return default_device()
    return torch.device("cpu")


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work, so a host clock reads the time the work took."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def average_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Means over ranks, except maxima and minima (keys ending in max or min), which stay extremes.

    Every rank must call it with the same keys; without a process group it returns `metrics`.
    """
    if not is_distributed():
        return dict(metrics)
    out = dict(metrics)
    for suffix, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("", dist.ReduceOp.SUM)):
        keys = sorted(k for k in metrics if (k.endswith(suffix) if suffix else not k.endswith(("max", "min"))))
        if not keys:
            continue
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t, op=op)
        if not suffix:
            t /= world_size()
        out.update(zip(keys, t.tolist()))
    return out


def ensure_process_group(device: torch.device | str | None = None) -> None:
    """Join torchrun's process group, or make one of size 1 in a plain process (for engines that need one).

    On a GPU the group has a gloo side beside nccl: state kept in host memory is
    reduced there, as are a checkpoint's host-side objects. A group made here is
    this process's for good: engines use it and never destroy it; a group of one
    is taken down at the process's exit (so NCCL does not warn of a leak).
    """
    if is_distributed():
        _hold_the_exit_for_collective_threads()  # a group the script made itself: our engines use it too
        return
    cuda = torch.device(device).type == "cuda" if device else torch.cuda.is_available()
    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"
    if cuda:
        index = torch.device(device).index if device else None
        torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        init(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _hold_the_exit_for_collective_threads()
        atexit.register(_destroy_own_group, dist.group.WORLD)  # runs first: handlers run last-in, first-out


def _destroy_own_group(group) -> None:
    """Take down the group of one `ensure_process_group` made, if it is still the process's group."""
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()
