"""Weights written straight into SGLang's parameters, inside its scheduler process.

SGLang's `update_weights_from_tensor` hands every tensor to the model's
`load_weights`, which matches each name against its fused parameters and calls
a weight loader, in Python, on every update: most of a sync's time at
Qwen2-0.5B's 290 tensors. Here the scheduler works out once, at engine start
(its weights still the model folder's), the slice of its parameters that each
weight of the engine's spec lands in (`gearshift.landing`: rows of the fused
q/k/v and gate/up parameters, a padded vocabulary's first rows, a tied head),
and keeps only the views that hold exactly the checkpoint's tensors. A bucket
(the host sends several of the trainer's buckets as one, up to its
`load_group_bytes`) is then one batched copy from the flat buffer into those views
(`copy_weights_`); the weights that did not land go through SGLang's own
loader, as before.

A bucket comes as SGLang's flattened-bucket payload (one flat byte buffer in
shared memory or CUDA IPC, and each tensor's name, shape, dtype and offsets)
the first time its buffer and layout (its names, in order) are seen. The
scheduler keeps the buffer and the views of each layout, so a later bucket of a
known layout in the same buffer comes as two numbers: nothing is unpickled, no
buffer is opened again, and no view is made per tensor.

SGLang's bookkeeping around an update: 0.5.23's weight-update session lets
its loader undo and redo SGLang's own packing of weights (quantized, AMX);
a weight it packs fails the check against the checkpoint and never lands, so
the engine opens a session only where some weight goes through the loader,
and a bucket with such weights is refused outside one, as SGLang refuses its
own loads. Its weight version stays (gearshift gives none). No model that
recomputes weights after loading (`post_load_weights`) has any weight written
directly.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from gearshift.landing import checkpoint_tensors, fused_modules, landing_views, load_units, verified_landing
from gearshift.stored import StoredLayout, stored_layout
from gearshift.weights import WeightSpec, copy_weights_


#: what a loading call whose weights landed raises when the scheduler was not idle enough to flush the prefix
#: cache after them (children.py `flush`): the host flushes it then
NOT_FLUSHED = "gearshift: the weights were loaded, the cache not flushed"


@dataclass
class Layout:
    """One bucket layout in the received buffer: what is copied where, and what SGLang's loader takes."""

    named: list[tuple[str, torch.Tensor]]  # every tensor of the bucket, as a typed view of the buffer
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    rest: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], landing: dict[str, tuple[torch.Tensor, ...]]) -> "Layout":
        layout = cls(named)
        for name, src in named:
            views = landing.get(name, ())
            for view in views:  # a tied head kept apart from the embedding gets the same rows twice
                layout.dsts.append(view)
                layout.srcs.append(src)
            if not views:
                layout.rest.append((name, src))
        return layout


class DirectLoad:
    """The scheduler's side: the views each weight lands in, the buffer last received and its layouts."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.stored = StoredLayout()  # the model folder's form of weights transformers holds otherwise (map)
        self.landing: dict[str, tuple[torch.Tensor, ...]] = {}
        #: (module, leaf, parameter, data pointer) of every parameter a view points into, as found at start
        self.owners: list[tuple[torch.nn.Module, str, torch.Tensor, int]] = []
        self.buffer: torch.Tensor | None = None  # kept: a reused buffer is not opened again on each sync
        self.buffer_id = -1
        self.layouts: dict[int, Layout] = {}
        #: the trainer's own tensors handed over (`sources`), kept between syncs, and where each lands
        self.sources: Layout | None = None
        self.checked_update = -1
        #: seconds each part of the last update's calls took in this process: receive (buffer or tensors
        #: opened), check (the views still SGLang's parameters), loader (SGLang's own), copy (the copies
        #: issued), flush (the update's prefix-cache flush, run while the device copies), wait (until the
        #: device finished them), and "calls" (how many)
        self.times: dict[str, float] = {}
        self.times_update = -1

    # --- at start -----------------------------------------------------------------------
    def map(self, spec: WeightSpec, checkpoint: str) -> dict:
        """Find and verify every weight's view against the checkpoint in folder `checkpoint`; the landed names."""
        model = self.runner.model
        reason = self._refusal(model)
        self.stored = stored_layout(checkpoint)  # SGLang's loader takes the folder's names (gearshift.stored)
        self.landing, self.owners = {}, []
        if reason is None:
            names = list(spec.names()) + list(spec.aliases)
            packed = fused_modules(model)
            units = load_units(names, {n for n, _ in model.named_modules()}, packed)
            views = landing_views(model, names, units, packed)
            verified = verified_landing(views, _with_aliases(checkpoint_tensors(checkpoint, spec), spec.aliases))
            self.landing = _tied(spec, views, verified)
            self.owners = _owners(model, self.landing)
        # layouts already received stay known to the host: they are planned again for the new views
        self._replan()
        return {"landed": sorted(self.landing), "reason": reason}

    def _replan(self) -> None:
        self.layouts = {k: Layout.of(v.named, self.landing) for k, v in self.layouts.items()}
        if self.sources is not None:
            self.sources = Layout.of(self.sources.named, self.landing)

    def _refusal(self, model) -> str | None:
        """Why no weight may be written around SGLang's loader, or None."""
        if callable(getattr(model, "post_load_weights", None)):
            return f"{type(model).__name__} recomputes weights after loading (post_load_weights)"
        # SGLang's own refusals (derived weight caches, its CUDA IPC weight cache), asked with nothing to load
        try:
            ok, message = self.runner.weight_updater.update_weights_from_tensor(named_tensors=[],
                                                                                load_format="direct")
        except Exception as e:  # noqa: BLE001 - SGLang raises some refusals: each one means "not here"
            return f"SGLang refuses weight updates here: {e}"
        return None if ok else f"SGLang refuses weight updates here: {message}"

    # --- on every bucket ----------------------------------------------------------------
    def load(self, payload: str, buffer: int, layout: int, update: int, loader_allowed: bool = True,
             while_copying: Callable[[], None] | None = None) -> None:
        """Load one bucket: `payload` (empty when this buffer and layout were received before) names them.
        Weights that did not land are refused unless `loader_allowed` (SGLang's loader may run now).
        `while_copying` (the update's prefix-cache flush) runs once the copies are issued and before the wait
        for them: its host work then costs nothing beside the copies on the GPU. The wait comes however it
        ends."""
        self._start_timing(update)
        self._apply(self._plan(payload, buffer, layout, update), loader_allowed, while_copying)

    def copy_sources(self, payload: str, update: int, loader_allowed: bool = True,
                     while_copying: Callable[[], None] | None = None) -> None:
        """Copy the trainer's tensors into SGLang's parameters: those of `payload` (SGLang's serialized
        (name, tensor) list, kept from now on), or with an empty one those kept from before. `while_copying`
        runs once the copies are issued, before waiting for them (`load`)."""
        self._start_timing(update)
        with self._timed("receive"):
            if payload:
                self.sources = None  # the old ones go first: a failure below leaves none
                self.sources = Layout.of(_deserialize(payload), self.landing)
        if self.sources is None:
            raise RuntimeError("gearshift: no trainer tensors were handed to this scheduler")
        self._check_once(update)
        self._apply(self.sources, loader_allowed, while_copying)

    def release_sources(self) -> None:
        self.sources = None

    def _start_timing(self, update: int) -> None:
        if update != self.times_update:
            self.times, self.times_update = {}, update
        self.times["calls"] = self.times.get("calls", 0) + 1

    @contextmanager
    def _timed(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[part] = self.times.get(part, 0.0) + time.perf_counter() - t0

    def _apply(self, plan: Layout, loader_allowed: bool,
               while_copying: Callable[[], None] | None = None) -> None:
        if plan.rest:  # first: a refusal by SGLang then leaves the whole bucket unapplied
            with self._timed("loader"):
                self._through_loader(plan.rest, loader_allowed)
        if plan.dsts:
            with self._timed("copy"):
                copy_weights_(plan.dsts, plan.srcs)
        try:
            if while_copying is not None:
                with self._timed("flush"):
                    while_copying()
        finally:
            if plan.named and plan.named[0][1].is_cuda:
                # the host writes the next bucket into the same buffer, or the trainer its next step into its
                # tensors, as soon as this call returns
                with self._timed("wait"):
                    torch.cuda.current_stream().synchronize()

    def _plan(self, payload: str, buffer: int, layout: int, update: int) -> Layout:
        if payload:
            with self._timed("receive"):
                self._receive(payload, buffer, layout)
        if buffer != self.buffer_id or layout not in self.layouts:
            raise RuntimeError(f"gearshift: layout {layout} of buffer {buffer} was never received by this scheduler "
                               f"(it holds buffer {self.buffer_id})")
        self._check_once(update)
        return self.layouts[layout]

    def _check_once(self, update: int) -> None:
        """Once per update: the views are still SGLang's parameters (`_check_views`)."""
        if update != self.checked_update:
            self.checked_update = update
            with self._timed("check"):
                self._check_views()

    def _through_loader(self, named: list[tuple[str, torch.Tensor]], allowed: bool) -> None:
        if not allowed:
            raise RuntimeError(f"gearshift: {len(named)} weights of this bucket go through SGLang's loader, "
                               f"which must run between begin_weight_update() and end_weight_update()")
        ok, message = self.runner.weight_updater.update_weights_from_tensor(
            named_tensors=list(self.stored.to_stored(named)), load_format=None)
        if not ok:
            raise RuntimeError(message)

    def _receive(self, payload: str, buffer: int, layout: int) -> None:
        data = _deserialize(payload)
        flat = data["flattened_tensor"]
        if buffer != self.buffer_id:  # a new buffer: the views of the old one go with it
            self.buffer, self.buffer_id, self.layouts = flat, buffer, {}
        named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)) for m in data["metadata"]]
        self.layouts[layout] = Layout.of(named, self.landing)

    def _check_views(self) -> None:
        """If SGLang replaced a parameter a view points into, every weight goes through its loader from now on."""
        moved = [leaf for module, leaf, param, ptr in self.owners
                 if module._parameters.get(leaf) is not param or param.data_ptr() != ptr]
        if moved:
            warnings.warn(f"gearshift: SGLang replaced {len(moved)} parameters that weights were written into "
                          f"directly; every weight goes through SGLang's loader from now on", RuntimeWarning)
            self.landing, self.owners = {}, []
            self._replan()


def _deserialize(payload: str):
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # as SGLang deserializes its own payloads (CUDA devices by uuid)
    return MultiprocessingSerializer.deserialize(payload)


def _with_aliases(checkpoint, aliases):
    """The checkpoint's (name, tensor), and each tensor again under every other name of it (a tied head)."""
    others: dict[str, list[str]] = {}
    for alias, name in aliases.items():
        others.setdefault(name, []).append(alias)
    for name, tensor in checkpoint:
        yield name, tensor
        for alias in others.get(name, ()):
            yield alias, tensor


def _tied(spec: WeightSpec, views: dict[str, torch.Tensor],
          verified: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """name -> the views it is copied into: its own, and a tied head's where SGLang keeps that apart (an
    embedding shared as the head has one view). A weight with any view unverified lands nowhere: SGLang's
    loader writes all of its copies."""
    out = {name: (verified[name],) for name in spec.names() if name in verified}
    for alias, name in spec.aliases.items():
        if alias not in views or name not in out:
            continue
        head = verified.get(alias)
        if head is None:
            del out[name]
        elif head.data_ptr() != out[name][0].data_ptr():
            out[name] += (head,)
    return out


def _owners(model: torch.nn.Module, landing: dict[str, tuple[torch.Tensor, ...]]):
    """(module, leaf, parameter, data pointer) of each parameter whose storage a view of `landing` is in."""
    storages = {v.untyped_storage().data_ptr() for views in landing.values() for v in views}
    out = []
    for name, param in model.named_parameters():
        if param.untyped_storage().data_ptr() in storages:
            module, _, leaf = name.rpartition(".")
            out.append((model.get_submodule(module), leaf, param, param.data_ptr()))
    return out
