"""pytest plugin (entry point `pytest11: gearshift`): fixtures, options and markers of the suite.

- `gearshift_model`: a tiny fp32 model folder built locally once per session
  (`--gearshift-model PATH|PRESET` picks another).
- `gearshift_shared_tmp`: a temporary folder that every rank of a torchrun job sees.
- markers `gpu` (skipped without CUDA) and `slow` (skipped unless `--runslow`).
- `expected_failures = {test name: reason}` on a suite class marks those tests xfail (strict).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("gearshift")
    group.addoption("--gearshift-model", default="tiny", help="model folder or preset for the suite (default: tiny)")
    group.addoption("--gearshift-train", default=None, help="train backend for the by-name suite")
    group.addoption("--gearshift-rollout", default=None, help="rollout backend for the by-name suite")
    group.addoption("--gearshift-options", default="{}", help="JSON: {'train': {...}, 'rollout': {...}} engine options")
    group.addoption("--gearshift-atol", default=None, type=float,
                    help="log-probability tolerance of the by-name suite (default: the suites' fp32 values)")
    group.addoption("--gearshift-budget", default=None,
                    help="override switch budgets, e.g. k=2,m=3,overhead_s=0.05 (see gearshift/budgets.yaml)")
    group.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: long-running; skipped unless --runslow")
    config.addinivalue_line("markers", "conformance: a contract from gearshift.conformance")


def pytest_collection_modifyitems(config, items):
    import torch

    has_gpu = torch.cuda.is_available()
    for item in items:
        cls = getattr(item, "cls", None)
        reasons = dict(getattr(cls, "expected_failures", None) or {})
        reasons.update(_backend_xfails(config, cls))
        name = getattr(item, "originalname", item.name)
        if name in reasons:
            item.add_marker(pytest.mark.xfail(reason=reasons[name], strict=True))
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("slow") and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))


def _backend_xfails(config, cls) -> dict[str, str]:
    """Expected failures a backend class declares (`conformance_xfail = {suite: {test: reason}}`)."""
    from .. import registry

    out: dict[str, str] = {}
    for kind in getattr(cls, "backend_kinds", ()):
        name = config.getoption(f"--gearshift-{kind}")
        if not name:
            continue
        try:
            backend = registry.load(kind, name)
        except registry.BackendError:
            continue  # the fixture reports it when the test runs
        suite = "pair" if len(cls.backend_kinds) > 1 else kind
        out.update(getattr(backend, "conformance_xfail", {}).get(suite, {}))
    return out


@pytest.fixture(scope="session")
def gearshift_shared_tmp_root():
    from .. import dist as gdist

    gdist.init()  # under torchrun: join first, so every rank gets rank 0's folder
    path = gdist.broadcast_object(tempfile.mkdtemp(prefix="gearshift-test-") if gdist.rank() == 0 else None)
    Path(path).mkdir(parents=True, exist_ok=True)
    yield Path(path)
    gdist.barrier()
    if gdist.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gearshift_shared_tmp(gearshift_shared_tmp_root, request):
    """A fresh folder per test, the same path on every rank."""
    from .. import dist as gdist

    path = gearshift_shared_tmp_root / request.node.name.replace("/", "_").replace("[", "_").replace("]", "_")
    if gdist.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    gdist.barrier()
    return path


@pytest.fixture(scope="session")
def gearshift_model(request, gearshift_shared_tmp_root):
    """A tiny model folder (fp32, random weights, byte-level tokenizer), built once on rank 0."""
    from .. import dist as gdist
    from ..tiny import PRESETS, build_model, resolve_model

    choice = request.config.getoption("--gearshift-model")
    if os.path.isdir(choice):
        return choice
    preset, _, arch = choice.partition("-llama")
    path = gearshift_shared_tmp_root / f"model-{choice}"
    if gdist.rank() == 0:
        if preset in PRESETS:
            build_model(path, preset=preset, arch="llama" if _ else "qwen2")
        else:
            resolve_model(choice)  # raises a clear error naming the presets
    gdist.barrier()
    return str(path)
