"""Keeping SGLang's process-wide side effects out of the trainer that shares the process.

Importing SGLang and starting an `Engine` change, in the host process (seen on
SGLang 0.5.23): environment variables (cache folders under ~/.cache/sglang,
`NCCL_*`, `CUDA_DEVICE_MAX_CONNECTIONS`, `TORCHINDUCTOR_*`, `LD_LIBRARY_PATH`
through OpenCV, a run id drawn from `random`), the asyncio event loop policy
(uvloop), the SIGTERM handler (the engine's loop takes it), the multiprocessing
start method (`spawn`, forced), the stack size limit, the root logger (a
handler, and its level), and Python's random generator. Its sockets and
temporary files go to the temporary directory.

`contained()` (the core's `gearshift.containment`) records all of this before a
block that calls into SGLang and puts it back after; SGLang's own variables (`SGLANG_*`) stay, since SGLang
reads them later. Around each later call the engine sets SGLang's event loop
policy again (its coroutines run on its loop). A scheduler process sends
SIGQUIT when it fails. While an engine starts, that is an error in the host
(`failed_while_starting`, given to SGLang as `custom_sigquit_handler`): the
start's processes are ended and its ZeroMQ contexts closed, where SGLang's own
handler would kill the host with no word. Once the engine runs, a failed
scheduler is an error too (`watch_schedulers`, `SchedulerFailed`): the call
that waits on it ends, or the engine's next call when it failed between calls,
and the engine is closed, where SGLang's handler would end the process tree,
host included. Once no engine is running (`guard_sigquit`), a
SIGQUIT from a child that is being shut down is ignored instead: it would end
the trainer, or a test session, after the engine had been closed on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gearshift import containment
from gearshift.containment import HostState
from gearshift.rollout import RolloutError

OWN_PREFIX = "SGLANG_"

logger = logging.getLogger(__name__)
#: SGLang's SIGQUIT handler, called only while `_running()` says an engine runs
_sglang_on_quit = None
_running = None


def guard_sigquit(running) -> None:
    """After an engine started: SIGQUIT goes to SGLang's handler only while `running()` is true.

    Called from the main thread (where Python handles signals); elsewhere it leaves the handler be."""
    global _sglang_on_quit, _running
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGQUIT)
    if current is not _on_quit:
        _sglang_on_quit = current
        signal.signal(signal.SIGQUIT, _on_quit)
    _running = running


class StartFailed(ValueError):
    """SGLang's scheduler failed while its engine started (an architecture it cannot build, too little memory):
    its traceback is printed above by the scheduler process."""


def failed_while_starting(signum, frame) -> None:
    """SIGQUIT while an engine starts (`custom_sigquit_handler`): the scheduler failed and said so. An error in
    the host, where SGLang's own handler would kill the whole process tree, host included, with no word."""
    raise StartFailed("SGLang's scheduler process failed while the engine started (its traceback is above): "
                      "a model architecture SGLang cannot build, or too little device memory; another rollout "
                      "backend (rollout.backend=vllm or hf) may serve this model")


class SchedulerFailed(RolloutError):
    """An SGLang scheduler process failed while its engine ran (its traceback is printed above by that process):
    the engine is closed, and the host lives on."""


FAILED_RUNNING = ("an SGLang scheduler process failed while its engine ran (its traceback is above): the engine "
                  "is closed; a model SGLang builds but cannot run (on a CPU, phi's attention), or too little "
                  "device memory; another rollout backend (rollout.backend=vllm or hf) may serve this model")


def failed_before_first_call(signum, frame) -> None:
    """SIGQUIT after an engine started, before its first call gives SGLang's event loop the signal: a scheduler
    failed. Logged; that engine's next call finds its scheduler gone and raises `SchedulerFailed`."""
    logger.error("SIGQUIT from an SGLang process: a scheduler failed; its engine's next call says so")


#: the call into a running engine now, if any: (SGLang's tokenizer manager, whether that engine's processes died)
_in_call: list = []
#: how long a SIGQUIT waits for a process of the engine in the call to end before it is taken for another's
#: (a failed scheduler sends SIGQUIT, then exits; SGLang's watchdog of a closed engine sends one too)
QUIT_GRACE_S = 10.0
QUIT_POLL_S = 0.1


@contextmanager
def in_call(manager, dead) -> Iterator[None]:
    """Around a call into a running engine: a SIGQUIT during it is that engine's failure if one of its processes
    ends (`dead()` true) within `QUIT_GRACE_S`."""
    _in_call.append((manager, dead))
    try:
        yield
    finally:
        _in_call.pop()


def _on_running_quit() -> None:
    """SIGQUIT, given by SGLang's event loop while a call runs on it: stop the call once one of its engine's
    processes has ended (the engine then finds it gone); a SIGQUIT of no process of that engine (the watchdog
    of an engine closed before) is logged and ignored."""
    if not _in_call:
        logger.warning("SIGQUIT from an SGLang process outside any call: ignored (the next call checks its engine)")
        return
    manager, dead = _in_call[-1]
    loop = manager.event_loop
    deadline = loop.time() + QUIT_GRACE_S

    def check() -> None:
        if not _in_call or _in_call[-1][0] is not manager:
            return  # that call ended: the engine's next call checks its processes itself
        if dead():
            logger.error("SIGQUIT from an SGLang process: the engine's scheduler failed")
            loop.stop()
        elif loop.time() < deadline:
            loop.call_later(QUIT_POLL_S, check)
        else:
            logger.warning("SIGQUIT from an SGLang process, but the engine in the call runs on: ignored")
    check()


def watch_schedulers(engine) -> None:
    """Once `engine` (SGLang's) runs, SIGQUIT from its scheduler ends the call that waits on it (its event loop
    stopped, see `_on_running_quit`), where SGLang's own handler, given the signal by the tokenizer
    manager's event loop, kills the host's whole process tree. On the main thread only (SGLang's rule too)."""
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class StopOnFailure(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            _on_running_quit()

    manager = engine.tokenizer_manager
    manager.signal_handler_class = StopOnFailure
    if manager.event_loop is not None and threading.current_thread() is threading.main_thread():
        manager.event_loop.add_signal_handler(signal.SIGQUIT, StopOnFailure(manager).running_phase_sigquit_handler)


def stop_watchdog(engine) -> None:
    """Stop SGLang's thread that watches `engine`'s processes: once they are ended on purpose, it would send the
    host SIGQUIT for each."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()


def _live_zmq_contexts() -> list:
    """The ZeroMQ contexts alive now (a walk over the collector's objects; none before zmq is imported). By
    `type()`: `isinstance` asks a weak proxy for its referent's class, and one whose referent is gone raises."""
    import gc

    zmq = sys.modules.get("zmq")
    return [o for o in gc.get_objects() if issubclass(type(o), zmq.Context)] if zmq is not None else []


def zmq_contexts() -> set[int]:
    """The ids of the ZeroMQ contexts alive now: a notebook's, another engine's."""
    return {id(o) for o in _live_zmq_contexts()}


def close_zmq_contexts(keep: set[int]) -> int:
    """Close every ZeroMQ context alive but those of `keep`, dropping unsent messages: what a failed engine start
    left (a socket still holding a message for the dead scheduler makes the context's finalizer, at the
    interpreter's exit, wait forever). The number closed."""
    stray = [o for o in _live_zmq_contexts() if id(o) not in keep and not o.closed]
    for context in stray:
        context.destroy(linger=0)
    return len(stray)


class _QuietCustomHandler(logging.Filter):
    """SGLang logs an error line whenever a custom SIGQUIT handler is given: gearshift gives one at every start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Using custom SIGQUIT handler")


def quiet_custom_handler_line() -> None:
    log = logging.getLogger("sglang.srt.entrypoints.engine")
    if not any(isinstance(f, _QuietCustomHandler) for f in log.filters):
        log.addFilter(_QuietCustomHandler())


def _on_quit(signum, frame) -> None:
    if _running is not None and _running() and callable(_sglang_on_quit):
        _sglang_on_quit(signum, frame)
    else:
        logger.warning("SIGQUIT from an SGLang process after its engine was closed: ignored")


def default_cache_dir() -> Path:
    return Path(os.environ.get("GEARSHIFT_CACHE", Path.home() / ".cache" / "gearshift")) / "sglang"


#: the longest temporary folder that leaves room for the socket names made in it (AF_UNIX paths: 107 bytes;
#: multiprocessing adds "/pymp-XXXXXXXX/listener-XXXXXXXX")
MAX_SOCKET_DIR = 64


def temp_dir(root: str | os.PathLike) -> Path:
    """SGLang's temporary folder, `root/tmp`; where that path is too long for the sockets made in it, a short
    private folder under /tmp named after it (the same one for the same `root`)."""
    path = Path(root).resolve() / "tmp"
    if len(str(path)) > MAX_SOCKET_DIR:
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        path = Path("/tmp") / f"gearshift-sglang-{os.getuid()}-{digest}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def cache_environment(root: str | os.PathLike) -> dict[str, str]:
    """SGLang's and its compilers' cache folders under `root`, and its temporary folder (`temp_dir`)."""
    root = Path(root)
    return {
        "SGLANG_CACHE_DIR": str(root / "cache"),
        "TRITON_CACHE_DIR": str(root / "cache" / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "cache" / "inductor"),
        "TMPDIR": str(temp_dir(root)),  # SGLang's IPC sockets; its child processes read it at start
    }


def _children() -> dict[int, "psutil.Process"]:
    import psutil

    try:
        return {c.pid: c for c in psutil.Process().children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _shared_helpers() -> set[int]:
    """multiprocessing's resource tracker and forkserver: started by whoever needs them first, used by all."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


@contextmanager
def started_processes() -> Iterator[list]:
    """The processes a block starts (with their children), to end with `end_processes` and no others.

    SGLang's `Engine.shutdown` kills every child of the host process (`kill_process_tree(os.getpid())`):
    a trainer's data workers, a Ray cluster it started, another engine. The engine records what its own start
    added and ends only that."""
    before = set(_children())
    started: list = []
    try:
        yield started
    finally:
        shared = _shared_helpers()
        started.extend(p for pid, p in _children().items() if pid not in before and pid not in shared)


def end_processes(processes: list, timeout_s: float = 60.0) -> None:
    """Kill `processes` and whatever they started since, and wait until each is gone."""
    import psutil

    doomed = {}
    for proc in processes:
        try:
            if proc.is_running():
                doomed[proc.pid] = proc
                doomed.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for proc in doomed.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(doomed.values()), timeout=timeout_s)
    if alive:
        raise RuntimeError(f"SGLang's processes {[p.pid for p in alive]} outlived SIGKILL for {timeout_s:.0f} s")


@contextmanager
def ending_only(processes: list) -> Iterator[None]:
    """Inside the block, SGLang's `kill_process_tree` of the host ends `processes` alone."""
    import sglang.srt.entrypoints.engine as sglang_engine

    own = sglang_engine.kill_process_tree

    def scoped(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid not in (None, os.getpid()) or include_parent:
            return own(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)
        end_processes(processes, wait_timeout or 60.0)

    sglang_engine.kill_process_tree = scoped
    try:
        yield
    finally:
        sglang_engine.kill_process_tree = own


def drop_channels(engine, keep: set | None = None) -> None:
    """After `Engine.shutdown`: cancel the tokenizer manager's tasks and close its sockets at once.

    Left to the garbage collector, pyzmq's context closes them with the default linger and then waits, forever,
    for messages to reach a scheduler that is gone: the host hung at its next collection. With `keep` (other
    engines' own tasks), after a scheduler failed in a call: every task of SGLang's event loop (shared by the
    engines of a thread) but those, the interrupted call's included; left pending, the collector ran them at
    exit, sending on closed sockets."""
    manager = getattr(engine, "tokenizer_manager", None)
    tasks = (getattr(manager, "asyncio_tasks", ()) if keep is None
             else [t for t in asyncio.all_tasks(engine.loop) if t not in keep])
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:  # cancelled, not failed: a failed task's wrapper would end the host's process tree
        task.cancel()
    if tasks:
        engine.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for name in ("recv_from_detokenizer", "send_to_scheduler"):
        sock = getattr(manager, name, None)
        if sock is not None and not sock.context.closed:
            sock.context.destroy(linger=0)


@contextmanager
def contained(env: dict[str, str], tmp: str | os.PathLike | None = None,
              loop_policy: asyncio.AbstractEventLoopPolicy | None = None) -> Iterator[HostState]:
    """Run a block that calls into SGLang with `env` set (and its event loop policy), the host's state put
    back afterwards (`gearshift.containment`); SGLang's own variables (SGLANG_*) stay."""
    with containment.contained(env, tmp, keep=OWN_PREFIX, loop_policy=loop_policy) as state:
        yield state


__all__ = ["HostState", "MAX_SOCKET_DIR", "OWN_PREFIX", "SchedulerFailed", "StartFailed", "cache_environment",
           "close_zmq_contexts", "contained", "default_cache_dir", "drop_channels", "end_processes", "ending_only",
           "failed_before_first_call", "failed_while_starting", "guard_sigquit", "in_call",
           "quiet_custom_handler_line", "started_processes", "stop_watchdog", "temp_dir", "watch_schedulers",
           "zmq_contexts"]
