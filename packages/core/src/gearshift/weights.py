"""What crosses a switch: named weights, where they live, and the buckets they travel in.

Names are Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`)
on both sides, as `AutoModelForCausalLM.named_parameters()` lists them: an
engine that stores weights differently (fused QKV, packed layouts) maps them on
load, as vLLM's and SGLang's `load_weights` do.

Tied weights: in a model whose output head shares the input embedding, the
spec lists the shared tensor once, under the name `named_parameters()` gives it
(`model.embed_tokens.weight` for most models), and records the other name
(`lm_head.weight`) in `aliases`. Either name is accepted wherever a weight is
named: `WeightSpec.check` maps an alias to the listed name, and the planner
matches a weight listed under one name on one side and the other name on the
other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Iterator, Mapping

import torch

from .mesh import MeshSpec, Placement


class WeightError(ValueError):
    """A weight name or shape that the receiving engine does not have."""


@dataclass(frozen=True)
class ParamSpec:
    """One full (unsharded) weight and its placement on a mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class WeightSpec:
    """The weights one side of a switch holds (train) or wants (rollout), in order."""

    mesh: MeshSpec
    params: tuple[ParamSpec, ...]
    #: other names of listed weights (a tied head): alias -> the listed name
    aliases: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: the global ranks the mesh's ranks 0, 1, ... are, when this side is one pool among others (a
    #: reshard between pools numbers the ranks of both); empty: ranks 0 to mesh.world_size - 1
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks and len(self.ranks) != self.mesh.world_size:
            raise WeightError(f"the spec lists {len(self.ranks)} global ranks for mesh {self.mesh} of "
                              f"{self.mesh.world_size}: give one per rank of the mesh")
        if len(set(self.ranks)) != len(self.ranks):
            raise WeightError(f"global ranks {self.ranks} repeat a rank")

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        mesh: MeshSpec | None = None,
        shards: Mapping[str, Mapping[str, int]] | None = None,
        dtype: torch.dtype | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> "WeightSpec":
        """Spec for full tensors; `shards[name]` = {axis: dim} for sharded ones."""
        mesh = mesh or MeshSpec()
        shards = shards or {}
        return cls(
            mesh,
            tuple(
                ParamSpec(n, tuple(t.shape), dtype or t.dtype, Placement.of(mesh, shards.get(n)))
                for n, t in tensors.items()
            ),
            dict(aliases or {}),
        )

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def by_name(self) -> dict[str, ParamSpec]:
        return dict(self._by_name)

    @cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    def local_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """name -> the shape of rank `rank`'s part of each weight; worked out once per rank and kept (read-only)."""
        cache = self.__dict__.setdefault("_local_shapes", {})
        shapes = cache.get(rank)
        if shapes is None:
            shapes = cache[rank] = {p.name: p.placement.local_shape(p.shape, rank) for p in self.params}
        return shapes

    def canonical(self, name: str) -> str:
        """The listed name of weight `name` (itself, or the weight an alias stands for)."""
        return self.aliases.get(name, name)

    def find(self, name: str, aliases: Mapping[str, str] | None = None) -> ParamSpec | None:
        """The listed weight called `name` here, or through this spec's or `aliases`' other names."""
        known = self.by_name()
        for candidate in (name, self.aliases.get(name), (aliases or {}).get(name)):
            if candidate is not None and candidate in known:
                return known[candidate]
        for alias, target in (aliases or {}).items():  # `name` is listed elsewhere; here under its alias
            if target == name and self.canonical(alias) in known:
                return known[self.canonical(alias)]
        return None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each rank of the mesh, in mesh order."""
        return self.ranks or tuple(range(self.mesh.world_size))

    def on_ranks(self, ranks) -> "WeightSpec":
        """The same weights, held by the given global ranks (mesh rank i is `ranks[i]`)."""
        return replace(self, ranks=tuple(int(r) for r in ranks))

    def mesh_rank(self, rank: int) -> int | None:
        """The mesh rank of global rank `rank`, or None when this side has no such rank."""
        if not self.ranks:
            return rank if 0 <= rank < self.mesh.world_size else None
        try:
            return self.ranks.index(rank)
        except ValueError:
            return None

    def replicated(self) -> "WeightSpec":
        """The same weights, whole on every rank (what a full export gathers)."""
        full = Placement.replicated(self.mesh)
        return replace(self, params=tuple(replace(p, placement=full) for p in self.params))

    def with_dtype(self, dtype: torch.dtype | None) -> "WeightSpec":
        if dtype is None:
            return self
        return replace(self, params=tuple(replace(p, dtype=dtype) for p in self.params))

    def check(self, tensors: Mapping[str, torch.Tensor], rank: int = 0) -> dict[str, torch.Tensor]:
        """The tensors under their listed names; `WeightError` unless each is a known weight of this
        rank's local shape (a tied weight sent under both names must be one tensor)."""
        shapes, aliases = self.local_shapes(rank), self.aliases
        out: dict[str, torch.Tensor] = {}
        for sent, tensor in tensors.items():  # on every sync's path: a few dictionary look-ups a weight
            name = aliases.get(sent, sent)
            if name in out and out[name] is not tensor and not torch.equal(out[name], tensor):
                others = sorted(a for a, t in self.aliases.items() if t == name)
                raise WeightError(f"{name!r} and its tied name {others} were both sent with different values: "
                                  f"they are one weight in this model; send it once")
            want = shapes.get(name)
            if want is None:
                close = [k for k in shapes if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
                hint = f"; names of that kind here: {close}" if close else ""
                raise WeightError(f"unknown weight {name!r}: this engine has {len(shapes)} weights{hint}")
            if tensor.shape != want:
                spec = self._by_name[name]
                raise WeightError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {want} "
                    f"(full {spec.shape}, placement {spec.placement})"
                )
            out[name] = tensor
        return out


@dataclass
class WeightBucket:
    """A group of weights streamed together: name -> this rank's tensor in the receiver's layout.

    `lent`: every tensor is the train engine's own storage (no copy, no cast, no gather), which
    keeps its place between syncs: written in place by each optimizer step, moved only when the
    trainer offloads its parameters, before which the actor calls the rollout engine's
    `release_sources`. A rollout engine may keep a hold on such tensors from one sync to the next
    and read them again at the next (SGLang's scheduler does, through CUDA IPC or shared memory).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    index: int = 0
    lent: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def items(self):
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)


@dataclass
class Adapter:
    """A LoRA adapter as it crosses a switch: every factor whole, in peft's file layout.

    `tensors` are named as in peft's `adapter_model.safetensors`
    (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`); `config` is
    what its `adapter_config.json` holds (`r`, `lora_alpha`, `target_modules`, ...).
    A rollout engine that serves adapters (`RolloutEngine.can_load_adapters`)
    applies it on top of its base weights, the model it was built from.
    """

    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, path) -> "Path":
        """Write it as a peft adapter folder (adapter_config.json, adapter_model.safetensors)."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True))
        save_file({n: t.detach().to("cpu").contiguous() for n, t in self.tensors.items()},
                  str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        return path


#: tensors of at least this many bytes are copied one `copy_` each: on a GPU a plain copy of a large tensor
#: runs nearer the memory bandwidth than `torch._foreach_copy_`'s chunked kernel (at the 7B shape on one
#: H200, 7.6 ms one by one against 10.0 ms batched), while small tensors cost a launch each unless batched
LARGE_COPY_BYTES = 16 << 20


def copy_weights_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], large: int = LARGE_COPY_BYTES) -> None:
    """`dst.copy_(src)` for each pair (casting as `copy_` does): the small ones in one batched copy, the large
    ones one by one."""
    small_d, small_s = [], []
    for d, s in zip(dsts, srcs, strict=True):
        if d.nbytes >= large:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)
