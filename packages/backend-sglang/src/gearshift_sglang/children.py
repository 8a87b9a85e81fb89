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
  by the KV cache, and the seconds each part of the last weight update took in
  the scheduler (`direct.DirectLoad.times`), to `path` as JSON (an RPC answers
  only success or failure).
- `gearshift_map_weights(spec_path, checkpoint, path)`: once at start, works out
  where each weight of the pickled spec at `spec_path` lands in the model's
  parameters, verified against the checkpoint in folder `checkpoint`, and writes
  the landed names to `path` as JSON (`direct.DirectLoad.map`).
- `gearshift_load(payload, buffer, layout, update, flush)`: one group of buckets,
  copied from the flat buffer into those views, the rest through SGLang's loader
  (`direct.DirectLoad.load`).
- `gearshift_sources(payload, update, flush)`: the trainer's own tensors (handed
  over in `payload` when new, else those kept from the last time) copied into
  those views in one batched copy (`direct.DirectLoad.copy_sources`);
  `gearshift_release_sources()` lets go of them.
- With `flush`, the last call of an update also flushes the prefix cache, which
  the host would otherwise ask for in a call of its own, between issuing the
  copies and waiting for them (its host work hides behind the GPU's copies); a scheduler not yet
  idle enough to flush raises `NOT_FLUSHED` once the weights are in, and the
  host flushes as before.
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
    scheduler.Scheduler.gearshift_map_weights = _map_weights
    scheduler.Scheduler.gearshift_load = _load
    scheduler.Scheduler.gearshift_sources = _sources
    scheduler.Scheduler.gearshift_release_sources = _release_sources
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
    direct = getattr(self, "gearshift_direct", None)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"weights": weights, "kv_cache": kv, "load_times": dict(direct.times) if direct else {}}, f)


def _map_weights(self, spec_path: str, checkpoint: str, path: str) -> None:
    import pickle

    from .direct import DirectLoad

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    if getattr(self, "gearshift_direct", None) is None:
        self.gearshift_direct = DirectLoad(self.tp_worker.model_runner)
    found = self.gearshift_direct.map(spec, checkpoint)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(found, f)


def _in_session(self) -> bool:
    # SGLang 0.5.23 keeps an update session (begin/end_weight_update) and refuses its own loads outside one:
    # weights that go through its loader are refused there too (0.5.17 has no sessions)
    return getattr(getattr(self, "weight_updater", None), "_session", True) is not None


def _load(self, payload: str, buffer: int, layout: int, update: int, flush: bool = False) -> None:
    self.gearshift_direct.load(payload, buffer, layout, update, loader_allowed=_in_session(self),
                               while_copying=_flush(self) if flush else None)


def _sources(self, payload: str, update: int, flush: bool = False) -> None:
    self.gearshift_direct.copy_sources(payload, update, loader_allowed=_in_session(self),
                                       while_copying=_flush(self) if flush else None)


def _flush(self):
    """The update's prefix-cache flush, here where its last call runs, saving the host a round trip, and while the
    GPU still copies the weights (`DirectLoad.load`), so its host work hides behind them; torch's cached blocks
    stay (the update allocated nothing that the next batch would not take again)."""
    from .direct import NOT_FLUSHED

    def flush() -> None:
        if not self.flush_cache(empty_cache=False):
            raise RuntimeError(NOT_FLUSHED)
    return flush


def _release_sources(self) -> None:
    direct = getattr(self, "gearshift_direct", None)
    if direct is not None:
        direct.release_sources()
