"""Weights as a model folder stores them, and as transformers holds them in memory.

transformers 5 converts some weights on load: a mixture-of-experts layer's
experts, one tensor per expert in the folder (`experts.3.gate_proj.weight`,
`experts.3.up_proj.weight`), become one tensor for all of them in memory
(`experts.gate_up_proj`, experts x (gate | up) x hidden), and Mixtral's
`block_sparse_moe` is renamed `mlp`. Trainers hold and send the in-memory
form; engines in vLLM's lineage load the stored form by name, and a name they
do not know may be dropped without a word. `StoredLayout` maps one to the
other for a model folder: `to_stored` cuts a sent tensor into the stored
tensors (views, no copies), `from_stored` assembles what a folder holds into
the in-memory form. The map is read once from the folder's safetensors headers
and transformers' own conversion rules (`rename_source_key`), so it follows
whatever transformers does for that architecture; a rule other than renaming
and stacking experts (and concatenating the stacks) is refused at start,
naming the weights, rather than sent wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .hf import meta_causal_lm


class StoredLayoutError(ValueError):
    """A model whose in-memory weights transformers derives from the stored ones in a way gearshift cannot undo."""


@dataclass(frozen=True)
class Piece:
    """One stored tensor of an in-memory weight: rows [start, start + size) of dimension `dim` of the weight,
    then index `expert` of its first dimension (None: the whole of it)."""

    key: str
    dim: int
    start: int
    size: int
    expert: int | None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        part = tensor.narrow(self.dim, self.start, self.size) if self.dim >= 0 else tensor
        return part if self.expert is None else part.select(0, self.expert)


@dataclass
class StoredLayout:
    """In-memory name -> the stored tensors it is made of, for the weights stored otherwise (none: the folder
    stores every weight as it is held)."""

    pieces: dict[str, tuple[Piece, ...]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each such weight's in-memory shape

    @property
    def plain(self) -> bool:
        return not self.pieces

    def stored_names(self) -> set[str]:
        return {p.key for ps in self.pieces.values() for p in ps}

    def to_stored(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in memory's form -> in the folder's (views of the tensors given)."""
        for name, tensor in items:
            pieces = self.pieces.get(name)
            if pieces is None:
                yield name, tensor
            else:
                for p in pieces:
                    yield p.key, p.view(tensor)

    def from_stored(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) as the folder stores them -> in memory's form, a weight once all of its pieces are read."""
        owner = {p.key: (name, p) for name, ps in self.pieces.items() for p in ps}
        building: dict[str, tuple[torch.Tensor, int]] = {}
        for key, tensor in items:
            if key not in owner:
                yield key, tensor
                continue
            name, piece = owner[key]
            whole, left = building.get(name) or (torch.empty(self.shapes[name], dtype=tensor.dtype),
                                                 len(self.pieces[name]))
            piece.view(whole).copy_(tensor)
            if left == 1:
                building.pop(name, None)
                yield name, whole
            else:
                building[name] = (whole, left - 1)


def _header_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                shapes[key] = tuple(st.get_slice(key).get_shape())
    return shapes


def _conversions(model):
    """transformers' rules for this model: (renamings, converters); none where this transformers has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers before 5 converts nothing
        return [], []
    rules = get_model_conversion_mapping(model, add_legacy=False)
    return ([r for r in rules if isinstance(r, WeightRenaming)], [r for r in rules if isinstance(r, WeightConverter)])


def _expert(pattern: str, key: str) -> int | None:
    if "*" not in pattern:
        return None
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return int(match.group(1)) if match else None


def stored_layout(model_path: str | Path) -> StoredLayout:
    """The map between the folder's stored weights and transformers' in-memory ones (worked out once per
    folder and version of its files)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    return _layout(str(model_path), tuple((f.name, f.stat().st_mtime_ns) for f in files))


@lru_cache(maxsize=8)
def _layout(model_path: str, files: tuple) -> StoredLayout:
    from transformers import AutoConfig

    shapes = _header_shapes(model_path)
    if not shapes:
        return StoredLayout()
    model = meta_causal_lm(AutoConfig.from_pretrained(model_path))
    renamings, converters = _conversions(model)
    if not renamings and not converters:
        return StoredLayout()
    from transformers.core_model_loading import rename_source_key

    held = dict(model.state_dict())
    by_pattern = {p: (c, i) for c in converters for i, p in enumerate(c.source_patterns)}
    groups: dict[str, tuple[object, list[tuple[str, int, int | None]]]] = {}
    for key in shapes:
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, held)
        if pattern is None:
            if name != key:
                groups[name] = (None, [(key, 0, None)])
            continue
        converter, source = by_pattern[pattern]
        groups.setdefault(name, (converter, []))[1].append((key, source, _expert(pattern, key)))
    return StoredLayout({name: _pieces(name, converter, members, shapes, held)
                         for name, (converter, members) in groups.items()},
                        {name: tuple(held[name].shape) for name in groups})


def _pieces(name: str, converter, members: list[tuple[str, int, int | None]], shapes: dict,
            held: dict) -> tuple[Piece, ...]:
    """The stored tensors of in-memory weight `name` as views of it; refused unless they tile it exactly."""
    keys = [m[0] for m in members]
    if name not in held:
        raise StoredLayoutError(f"stored weights {keys[:3]} map to {name!r}, which the model does not have")
    target = tuple(held[name].shape)
    if converter is None:
        if shapes[keys[0]] != target:
            raise StoredLayoutError(f"{keys[0]!r} is stored {shapes[keys[0]]} and held as {name!r} {target}: "
                                    f"transformers reshapes it on load, which gearshift's sync does not undo")
        return (Piece(keys[0], -1, 0, 0, None),)
    ops = getattr(converter, "operations", None) or []
    kinds = [type(op).__name__ for op in ops]
    experts = sorted({e for _, _, e in members if e is not None})
    sources = sorted({s for _, s, _ in members})
    refuse = StoredLayoutError(
        f"transformers builds {name!r} {target} from {len(members)} stored tensors ({keys[0]!r}, ...) by {kinds}: "
        f"gearshift's sync into engines that load the stored form (vllm, sglang) undoes only renaming and "
        f"stacking experts, then concatenating the stacks; train this model with rollout.backend=hf")
    untiled = StoredLayoutError(f"the {len(members)} stored tensors of {name!r} ({keys[0]!r}, ...) do not tile "
                                f"its in-memory shape {target}")
    if kinds not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or getattr(ops[0], "dim", 0) != 0 \
            or any(e is None for _, _, e in members) or experts != list(range(len(experts))) \
            or len(members) != len(experts) * len(sources):
        raise refuse
    shape = {s: shapes[next(k for k, src, _ in members if src == s)] for s in sources}
    if any(shapes[k] != shape[s] for k, s, _ in members):
        raise refuse
    first = shape[sources[0]]
    if len(kinds) == 1:
        if len(sources) != 1 or (len(experts), *first) != target:
            raise untiled
        return tuple(Piece(k, -1, 0, 0, e) for k, _, e in sorted(members, key=lambda m: m[2]))
    dim = ops[1].dim  # in the stacked tensor's dimensions: the stored tensor's dim - 1
    if dim < 1 or dim > len(first) or any(shape[s][:dim - 1] + shape[s][dim:] != first[:dim - 1] + first[dim:]
                                          for s in sources):
        raise refuse
    starts, total = {}, 0
    for s in sources:
        starts[s], total = total, total + shape[s][dim - 1]
    if (len(experts), *first[:dim - 1], total, *first[dim:]) != target:
        raise untiled
    return tuple(Piece(k, dim, starts[s], shape[s][dim - 1], e) for k, s, e in sorted(members, key=lambda m: m[1:]))


__all__ = ["Piece", "StoredLayout", "StoredLayoutError", "stored_layout"]
