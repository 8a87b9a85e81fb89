"""Weights into a vLLM engine: the streams it is fed (where each lands in vLLM's storage: `gearshift.landing`).

The engine's spec is the core's `gearshift.hf.weight_spec_of` (the trainer's names, full
shapes, whole on every rank: vLLM's own loaders cut them for tensor parallelism).

On CPU, vLLM prepacks linear weights for oneDNN and re-packs a layer only once
all of its weights have arrived (q, k and v together make one `qkv_proj`). A
stream is therefore cut into *load units*, one per vLLM module, and a unit is
passed on only when it is complete: a bad bucket found mid-stream then stops
the load between units, never inside one, and the engine keeps serving.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import torch

# where weights land in vLLM's storage is the core's (shared with the sglang backend); named here too, as before
from gearshift.landing import checkpoint_tensors, landing_views, load_units, verified_landing  # noqa: F401
from gearshift.weights import WeightBucket, WeightError, WeightSpec


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
