"""One SGLang engine for the whole session (a start costs 20-70 s on two cores).

Its files go to a folder under the system's temporary directory (kept between
sessions), never the home directory; `GEARSHIFT_SGLANG_TEST_CACHE` picks another.
Every call of the sgl_kernel stand-in is written to a file the tests read.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch

from gearshift.conformance.util import as_buckets, reference_weights
from gearshift_sglang import kernel

KV_CACHE_BYTES = 32 << 20

if importlib.util.find_spec("sglang") is None:
    collect_ignore = ["test_conformance.py", "test_engine.py"]


@pytest.fixture(scope="session")
def sglang_cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"gearshift-sglang-test-{os.getuid()}"
    path = Path(os.environ.get("GEARSHIFT_SGLANG_TEST_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def kernel_trace(sglang_cache_dir) -> Path:
    """The file every sgl_kernel stand-in call is appended to, in any of SGLang's processes."""
    path = sglang_cache_dir / f"sgl_kernel-calls-{os.getpid()}.txt"
    path.unlink(missing_ok=True)
    os.environ[kernel.TRACE_ENV] = str(path)
    return path


@pytest.fixture(scope="session")
def host_before_engine() -> dict:
    import asyncio
    import multiprocessing
    import signal

    return {"environ": dict(os.environ), "threads": torch.get_num_threads(),
            "sigterm": signal.getsignal(signal.SIGTERM), "start_method": multiprocessing.get_start_method(True),
            "policy": type(asyncio.get_event_loop_policy()), "home_cache": (Path.home() / ".cache" / "sglang")}


@pytest.fixture(scope="session")
def sglang_options(sglang_cache_dir) -> dict:
    """The options every engine of these tests is built with. sleep_on_idle: the session's engine lives to the
    session's end, and a scheduler polling its sockets would keep one of CI's two cores busy through every later
    package's tests."""
    return {"cache_dir": str(sglang_cache_dir), "kv_cache_bytes": KV_CACHE_BYTES, "sleep_on_idle": True}


@pytest.fixture(scope="session")
def sglang_engine(gearshift_model, sglang_options, kernel_trace, host_before_engine):
    from gearshift_sglang import SGLangRolloutEngine

    engine = SGLangRolloutEngine.build(gearshift_model, **sglang_options)
    yield engine
    engine.close()


@pytest.fixture
def serving_model_weights(sglang_engine, gearshift_model):
    """The session engine, awake and serving the model folder's weights again after the test."""
    yield sglang_engine
    restore(sglang_engine, gearshift_model)


def restore(engine, model_path: str) -> None:
    engine.wake(["weights", "kv_cache"])
    engine.update_weights(as_buckets(reference_weights(model_path, engine.weight_spec()), engine.device))
