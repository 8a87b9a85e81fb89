"""What runs first in SGLang's scheduler and detokenizer processes (spawned, so they import afresh).

`Engine` starts these functions in place of SGLang's own. Multiprocessing
unpickles a process's target before its arguments (which hold SGLang objects),
so importing this module, which prepares the imports (`imports.prepare`), comes
before SGLang is imported there; the functions then hand over to SGLang's.

The scheduler gets two methods that the engine calls through SGLang's
`collective_rpc` (which runs a scheduler method by name):
- `gearshift_reseed(seed)`: SGLang's CPU sampler draws from the scheduler
  process's global generator, and per-request seeds need its deterministic mode,
  which it refuses with the CPU attention backend. The engine reseeds before
  each `generate`; one batch of requests reaches the scheduler as one message,
  so the same seed, prompts and sampling give the same samples.
- `gearshift_freeze_gc()`: moves the objects alive after start-up out of the
  garbage collector's reach. SGLang's CPU platform runs `gc.collect()` on every
  cache flush, which walked the whole heap of the scheduler (torch, transformers,
  SGLang): 420-430 ms of each weight update of a tiny model, against 1 ms after.
  This is SGLang's own `freeze_gc`, applied to the scheduler only (SGLang's
  `Engine.freeze_gc()` would freeze the host's heap too).
- `gearshift_report(path)`: writes the bytes held by the model's parameters and
  by the KV cache to `path` as JSON (an RPC answers only success or failure).
"""

from __future__ import annotations

import json
import random

from .imports import prepare

prepare()  # on import: the process's arguments, unpickled next, import SGLang


def run_scheduler_process(*args, **kwargs):
    from sglang.srt.managers import scheduler

    scheduler.Scheduler.gearshift_reseed = _reseed
    scheduler.Scheduler.gearshift_report = _report
    scheduler.Scheduler.gearshift_freeze_gc = _freeze_gc
    return scheduler.run_scheduler_process(*args, **kwargs)


def run_detokenizer_process(*args, **kwargs):
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as run

    return run(*args, **kwargs)


def _reseed(self, seed: int) -> None:
    import numpy
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed % (1 << 32))


def _freeze_gc(self) -> None:
    import gc

    gc.collect()
    gc.freeze()


def _report(self, path: str) -> None:
    from gearshift.memory import tensor_bytes

    runner = self.tp_worker.model_runner
    weights = tensor_bytes(list(runner.model.parameters()))
    pool = runner.token_to_kv_pool
    kv = tensor_bytes([getattr(pool, name, None) for name in ("k_buffer", "v_buffer", "kv_buffer")])
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"weights": weights, "kv_cache": kv}, f)

