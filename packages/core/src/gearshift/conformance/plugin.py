"""The suite's pytest plugin, opt-in: fixtures, options and expected failures.

A test suite asks for it: `pytest_plugins = ["gearshift.conformance.plugin"]` in
its root conftest.py, or `pytest -p gearshift.conformance.plugin`
(`gearshift conformance` passes it). Installing gearshift registers nothing with
pytest.

- `gearshift_model`: a tiny fp32 model folder built locally once per session
  (`--gearshift-model PATH|PRESET` picks another).
- `gearshift_shared_tmp`: a temporary folder that every rank of a torchrun job sees.
- `gearshift_ray_cluster`: a local Ray cluster of two nodes, started once per session
  (skipped where Ray is not installed).
- expected failures, one way: a backend class declares `conformance_xfail =
  {"rollout"|"train"|"pair": {test name: reason}}`; a suite class names the
  backends it checks (`rollout_backend`, `train_backend`, or by name on the
  command line) and their entries are marked xfail (strict) there. A suite class
  that declares them itself (`expected_failures`, the earlier way, or its own
  `conformance_xfail`) is refused, so a declared failure is never silently lost.
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


def pytest_collection_modifyitems(config, items):
    for cls in {item.cls for item in items if getattr(item, "cls", None) is not None}:
        refuse_suite_declared_failures(cls)
    for item in items:
        reasons = expected_failures(config, getattr(item, "cls", None))
        name = getattr(item, "originalname", item.name)
        if name in reasons:
            item.add_marker(pytest.mark.xfail(reason=reasons[name], strict=True))


def refuse_suite_declared_failures(cls) -> None:
    """A suite class that declares expected failures itself: an error naming the one way to declare them."""
    for attr in ("expected_failures", "conformance_xfail"):
        if _is_suite(cls) and hasattr(cls, attr):
            raise pytest.UsageError(
                f"{cls.__module__}.{cls.__qualname__}.{attr} is not read: declare expected failures on the "
                f"backend class, as conformance_xfail = {{'rollout'|'train'|'pair': {{test name: reason}}}}, and "
                f"name that class on the suite (rollout_backend = ..., train_backend = ...); see the README, "
                f"'Writing a backend'")


def _is_suite(cls) -> bool:
    from .pair import PairSuite
    from .rollout import RolloutEngineSuite
    from .train import TrainEngineSuite

    return issubclass(cls, (PairSuite, RolloutEngineSuite, TrainEngineSuite))


def expected_failures(config, cls) -> dict[str, str]:
    """{test: reason} that the backends a suite class checks declare for that suite."""
    from .. import registry
    from .pair import PairSuite
    from .rollout import RolloutEngineSuite
    from .train import TrainEngineSuite

    if cls is None:
        return {}
    suite = next((kind for kind, base in (("pair", PairSuite), ("rollout", RolloutEngineSuite),
                                          ("train", TrainEngineSuite)) if issubclass(cls, base)), None)
    if suite is None:
        return {}
    out: dict[str, str] = {}
    for kind in ("train", "rollout"):
        backend = getattr(cls, f"{kind}_backend", None)
        if backend is None and getattr(cls, "backends_from_options", False):
            name = config.getoption(f"--gearshift-{kind}")
            try:
                backend = registry.load(kind, name) if name else None
            except registry.BackendError:
                backend = None  # the fixture reports it when the test runs
        if backend is not None:
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
    gdist.leave()  # the last session fixture to end: no collective follows


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
    """A tiny model folder (fp32, random weights, byte-level tokenizer), built once on rank 0.

    `--gearshift-model` picks a folder or another preset ('tiny-gpt2', 'small', ...).
    """
    from .. import dist as gdist
    from ..rl import resolve_model  # gearshift.models' own, with the task models registered

    choice = request.config.getoption("--gearshift-model")
    if os.path.isdir(choice):
        return choice
    path = resolve_model(choice, cache_dir=gearshift_shared_tmp_root) if gdist.rank() == 0 else None
    return gdist.broadcast_object(path)


@pytest.fixture(scope="session")
def gearshift_ray_cluster():
    """Ray's own test cluster on this machine: two nodes of 2 CPUs each, started once per session (a split
    run's pools join it), stopped at the end. Skipped where Ray is not installed."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    for attempt in range(3):  # Ray gives each raylet 30 s to come up, which a crowded machine can miss
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=2, object_store_memory=256 << 20)
            cluster.add_node(num_cpus=2, object_store_memory=256 << 20)
            break
        except Exception:
            cluster.shutdown()
            if attempt == 2:
                raise
    ray.init(address=cluster.address, log_to_driver=True)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
