"""Weights into a vLLM engine: where each lands in vLLM's storage, and the streams it is fed.

The engine's spec is the core's `gearshift.hf.weight_spec_of` (the trainer's names, full
shapes, whole on every rank: vLLM's own loaders cut them for tensor parallelism).

On CPU, vLLM prepacks linear weights for oneDNN and re-packs a layer only once
all of its weights have arrived (q, k and v together make one `qkv_proj`). A
stream is therefore cut into *load units*, one per vLLM module, and a unit is
passed on only when it is complete: a bad bucket found mid-stream then stops
the load between units, never inside one, and the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from gearshift.weights import WeightBucket, WeightError, WeightSpec


def load_units(names: Iterable[str], modules: set[str], packed: Mapping[str, list[str]]) -> dict[str, str]:
    """name -> the vLLM module its weight loads into (the unit that must arrive whole).

    `packed` is the model's `packed_modules_mapping` ({"qkv_proj": ["q_proj", ...]}); a
    name whose module vLLM does not have maps to its nearest ancestor that it has.
    """
    fused = {part: whole for whole, parts in packed.items() for part in parts}
    units = {}
    for name in names:
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        if leaf in fused and _join(parent, fused[leaf]) in modules:
            units[name] = _join(parent, fused[leaf])
            continue
        while module and module not in modules:
            module = module.rpartition(".")[0]
        units[name] = module
    return units


def _join(parent: str, leaf: str) -> str:
    return f"{parent}.{leaf}" if parent else leaf


class UnitFeeder:
    """Checks a bucket stream and yields (name, tensor) one whole load unit at a time.

    Every bucket is checked against the spec before any of it moves on. Pieces of a
    unit are held (references, no copies) until the unit is complete. A bad bucket,
    or an error in the stream itself, ends the iteration cleanly: `error` holds it,
    held pieces are dropped, and what was yielded before is whole units only.
    """

    def __init__(self, buckets: Iterable[WeightBucket], spec: WeightSpec, units: Mapping[str, str],
                 rank: int = 0) -> None:
        self._buckets = buckets
        self._spec = spec
        self._rank = rank
        self._units = units
        self._members: dict[str, set[str]] = {}
        for name, unit in units.items():
            self._members.setdefault(unit, set()).add(name)
        self.error: BaseException | None = None
        self.loaded_names: list[str] = []
        self.bytes = 0
        self.incomplete: dict[str, list[str]] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        held: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for bucket in self._buckets:
                for name, tensor in self._spec.check(bucket.tensors, self._rank).items():
                    unit = self._units[name]
                    pieces = held.setdefault(unit, {})
                    pieces[name] = tensor
                    if len(pieces) == len(self._members[unit]):
                        del held[unit]
                        for n, t in pieces.items():
                            self.loaded_names.append(n)
                            self.bytes += t.numel() * t.element_size()
                            yield n, t
                del bucket
        except Exception as e:  # noqa: BLE001 - handed back to the caller after vLLM finished the load
            self.error = e
        self.incomplete = {u: sorted(self._members[u] - set(p)) for u, p in held.items()}

    def raise_if_failed(self) -> None:
        if self.error is not None:
            note = (f" ({len(self.loaded_names)} weights from the buckets before it were applied, in whole "
                    f"layers; the rest kept their old values)" if self.loaded_names else
                    " (no weight was applied)")
            if isinstance(self.error, WeightError):
                raise WeightError(f"{self.error}{note}") from self.error
            raise self.error
        if self.incomplete:
            unit, missing = next(iter(self.incomplete.items()))
            raise WeightError(
                f"{sum(len(m) for m in self.incomplete.values())} weights were missing from {len(self.incomplete)} "
                f"layers that were only partly sent, first {unit!r} without {missing}: vLLM on CPU repacks a layer "
                f"as a whole, so send all of its weights in one update (those layers kept their old values)"
            )


def landing_views(model: torch.nn.Module, names: Iterable[str], units: Mapping[str, str],
                  packed: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """name -> the slice of vLLM's parameter storage that weight `name` is loaded into.

    A weight that vLLM fuses (q, k and v into `qkv_proj`; gate and up into `gate_up_proj`)
    lands in rows of the fused parameter, at the offsets its module's
    `output_partition_sizes` give; a padded vocabulary keeps the checkpoint's rows first.
    Only unsharded modules (tensor parallel size 1) are mapped: a weight left out is loaded
    through vLLM's `load_weights`. A module vLLM wrapped to serve LoRA adapters keeps the
    weight in its `base_layer`. `verified_landing` then keeps only the views that hold
    exactly what the checkpoint holds, so a weight vLLM transforms on load is never written
    around its loader.
    """
    fused = {part: (whole, i) for whole, parts in packed.items() for i, part in enumerate(parts)}
    params = dict(model.named_parameters())
    views: dict[str, torch.Tensor] = {}
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        unit = owner = units.get(name)
        if unit and f"{unit}.base_layer.{leaf}" in params:  # vLLM's LoRA wrapper: the weight is its base layer's
            owner = f"{unit}.base_layer"
        target = params.get(f"{owner}.{leaf}") if owner else None
        if target is None:
            continue
        module = model.get_submodule(owner)
        if getattr(module, "tp_size", 1) != 1:
            continue
        part = module_name.rpartition(".")[2]
        if part in fused and unit.rpartition(".")[2] == fused[part][0]:
            sizes = getattr(module, "output_partition_sizes", None)
            index = fused[part][1]
            if sizes is None or len(sizes) != len(packed[fused[part][0]]):
                continue
            start = sum(sizes[:index])
            views[name] = target.data[start:start + sizes[index]]
        else:
            views[name] = target.data
    return views


@torch.no_grad()
def verified_landing(views: Mapping[str, torch.Tensor],
                     checkpoint: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The views that hold exactly the checkpoint's tensor (cut to its rows where vLLM pads them).

    A tensor whose elements are all equal (a freshly initialised bias or norm) matches a view
    whatever order vLLM put its elements in; it counts only if no tensor of its module failed the
    check (BLOOM's fused query_key_value, which vLLM re-orders on load: its weight fails, and its
    zero bias must not be written in place either).
    """
    out, failed_modules, uniform = {}, set(), {}
    for name, saved in checkpoint:
        module = name.rpartition(".")[0]
        view = views.get(name)
        if view is None or view.dim() != saved.dim() or view.shape[1:] != saved.shape[1:] \
                or view.shape[0] < saved.shape[0]:
            failed_modules.add(module)
            continue
        view = view[: saved.shape[0]]
        if not torch.equal(view, saved.to(view.device, view.dtype)):
            failed_modules.add(module)
        elif saved.numel() > 1 and bool((saved == saved.reshape(-1)[0]).all()):
            uniform[name] = view
        else:
            out[name] = view
    out.update({n: v for n, v in uniform.items() if n.rpartition(".")[0] not in failed_modules})
    return out


def checkpoint_tensors(model_path: str, spec: WeightSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the folder's safetensors files for the weights of `spec`, one file open at a time."""
    from safetensors import safe_open

    wanted = set(spec.names()) | set(spec.aliases)
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in wanted:
                    yield spec.canonical(key), st.get_tensor(key)
