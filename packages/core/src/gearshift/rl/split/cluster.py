"""Ray: joining a cluster (or starting one here), reserving each pool, starting its workers, collecting results.

Each pool is a placement group of one bundle per worker (a GPU each when the
pool runs on GPUs, `cpus_per_worker` CPUs), packed onto as few nodes as
possible; one Ray actor per bundle. The driver talks to workers only through
`Pool.call` and `Calls.wait`, which turn a worker that died into `WorkerLost`
naming it, and an error raised in a worker into `WorkerError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

#: environment variables passed on to every worker (besides what Ray passes itself)
PASSED_ENV = ("GEARSHIFT_CACHE", "GEARSHIFT_DIST_TIMEOUT", "HF_HOME", "VLLM_LOGGING_LEVEL")
START_ATTEMPTS = 3


class WorkerLost(RuntimeError):
    """A worker process died (killed, out of memory, its node gone); the run stopped."""

    def __init__(self, worker: str, what: str, cause: str) -> None:
        super().__init__(f"worker {worker} died during {what}: {cause}")
        self.worker, self.what = worker, what


class WorkerError(RuntimeError):
    """A worker raised an error; the run stopped."""

    def __init__(self, worker: str, what: str, cause: BaseException | str) -> None:
        super().__init__(f"worker {worker} failed in {what}: {cause}")
        self.worker, self.what, self.cause = worker, what, cause


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("run.placement=split runs its pools on Ray, which is not installed: "
                          "pip install 'gearshift[ray]'") from None
    return ray


def connect(address: str = "", num_cpus: float | None = None) -> bool:
    """Join the cluster at `address` ('auto': the one this node belongs to), or start one on this machine
    with at least `num_cpus` CPUs; returns whether this process started it. A connected process stays."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    runtime_env = {"env_vars": env} if env else None
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return False
    for attempt in range(START_ATTEMPTS):
        try:
            ray.init(num_cpus=max(int(num_cpus or 0), os.cpu_count() or 1), include_dashboard=False,
                     runtime_env=runtime_env, log_to_driver=True)
            return True
        except Exception as err:  # Ray gives its raylet 30 s to come up, too short on a crowded machine
            ray.shutdown()
            if "timed out during startup" not in str(err) or attempt == START_ATTEMPTS - 1:
                raise
            print(f"gearshift: Ray did not start ({err}); trying again", flush=True)
    return True


def cluster_gpus() -> int:
    return int(import_ray().cluster_resources().get("GPU", 0))


@dataclass
class Call:
    """One pending call on a worker."""

    ref: Any
    worker: str
    what: str


class Calls:
    """Calls in flight on any worker; waiting for some watches all of them, so a worker that dies while
    others wait on it (in a collective) is reported at once, not after the collective's timeout."""

    def __init__(self) -> None:
        self.pending: dict[Any, Call] = {}
        self.done: dict[Any, Any] = {}

    def add(self, calls: Iterable[Call]) -> list[Any]:
        refs = []
        for call in calls:
            self.pending[call.ref] = call
            refs.append(call.ref)
        return refs

    def wait(self, refs: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """The results of `refs` in order, once all are in; raises `WorkerLost` / `WorkerError` on the first
        call of any in flight that fails, and `TimeoutError` after `timeout_s`."""
        import time

        ray = import_ray()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(r not in self.done for r in refs):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if left == 0.0:
                raise TimeoutError(f"no result from {sorted({self.pending[r].worker for r in refs if r in self.pending})} "
                                   f"after {timeout_s:.0f} s")
            if not self.pending:
                raise RuntimeError("waiting for results of calls that were never made")
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=left)
            for ref in ready:
                call = self.pending.pop(ref)
                self.done[ref] = self._result(call)
        return [self.done.pop(r) for r in refs]

    def drain(self) -> None:
        """Wait for every call in flight (their results are dropped)."""
        refs = list(self.pending)
        self.wait(refs)

    @staticmethod
    def _result(call: Call) -> Any:
        ray = import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(call.ref)
        except RayActorError as err:
            raise WorkerLost(call.worker, call.what, _first_line(err)) from None
        except RayTaskError as err:
            cause = err.cause if getattr(err, "cause", None) is not None else _first_line(err)
            raise WorkerError(call.worker, call.what, cause) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


class Pool:
    """The workers of one pool: a placement group of `size` bundles and one actor of `worker_cls` on each."""

    def __init__(self, name: str, size: int, worker_cls: type, *, gpus: bool, cpus: float,
                 timeout_s: float = 600.0) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.size, self.gpus = name, size, gpus
        bundle = {"CPU": cpus, **({"GPU": 1} if gpus else {})}
        self.group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            have = ray.available_resources()
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(f"the {name} pool needs {size} x {bundle} and the cluster has "
                               f"{ {k: v for k, v in have.items() if k in ('CPU', 'GPU')} } free: lower "
                               f"run.pools.{name} or run.pools.cpus_per_worker, or add nodes")
        remote = ray.remote(worker_cls)
        self.workers = [
            remote.options(num_cpus=cpus, num_gpus=1 if gpus else 0, max_restarts=0, max_task_retries=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i)).remote(name, i, size)
            for i in range(size)
        ]
        self.labels = [f"{name}/{i}" for i in range(size)]

    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None, **kwargs: Any) -> list[Call]:
        """`method(*args, **kwargs)` on every worker, or `method(*per_rank[i])` on worker i."""
        calls = []
        for i, (worker, label) in enumerate(zip(self.workers, self.labels)):
            call_args = per_rank[i] if per_rank is not None else args
            calls.append(Call(getattr(worker, method).remote(*call_args, **kwargs), label, method))
        return calls

    def describe(self, where: Sequence[dict]) -> list[str]:
        """Labels with where each worker runs (`where`: what each worker's `where()` returned)."""
        return [f"{label} (node {w['node']}, pid {w['pid']}{', gpu ' + w['gpus'] if w['gpus'] else ''})"
                for label, w in zip(self.labels, where)]

    def kill(self) -> None:
        """End every worker at once (a worker waiting in a collective does not return) and free the bundles."""
        ray = import_ray()
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already gone
                pass
        try:
            ray.util.remove_placement_group(self.group)
        except Exception:
            pass
