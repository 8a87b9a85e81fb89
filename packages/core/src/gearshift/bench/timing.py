"""What every benchmark measures with: the model folder resolved once, the median of repeated runs."""

from __future__ import annotations

import statistics
import time

from .. import dist as gdist


def resolve_once(model: str) -> str:
    """The model's folder, built by rank 0 alone (transformers writes a model from the main process only)."""
    from ..rl import resolve_model  # gearshift.models' own, with the task models registered

    return gdist.broadcast_object(resolve_model(model) if gdist.rank() == 0 else None)


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`, every rank synchronized before and after each."""
    times = []
    for _ in range(repeats):
        gdist.synchronize()
        t0 = time.perf_counter()
        fn()
        gdist.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
