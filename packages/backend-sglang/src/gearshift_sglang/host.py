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
policy again (its coroutines run on its loop). SIGQUIT stays SGLang's while an
engine runs: its scheduler process sends it when it fails, and SGLang's handler
then ends the process tree, host included (a host left running would wait
forever on a dead scheduler). Once no engine is running (`guard_sigquit`), a
SIGQUIT from a child that is being shut down is ignored instead: it would end
the trainer, or a test session, after the engine had been closed on purpose.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gearshift import containment
from gearshift.containment import HostState

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


@contextmanager
def contained(env: dict[str, str], tmp: str | os.PathLike | None = None,
              loop_policy: asyncio.AbstractEventLoopPolicy | None = None) -> Iterator[HostState]:
    """Run a block that calls into SGLang with `env` set (and its event loop policy), the host's state put
    back afterwards (`gearshift.containment`); SGLang's own variables (SGLANG_*) stay."""
    with containment.contained(env, tmp, keep=OWN_PREFIX, loop_policy=loop_policy) as state:
        yield state


__all__ = ["HostState", "MAX_SOCKET_DIR", "OWN_PREFIX", "cache_environment", "contained", "default_cache_dir",
           "guard_sigquit", "temp_dir"]
