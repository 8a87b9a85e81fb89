"""What each tensor-parallel rank of a vLLM engine keeps of every weight, so a sync sends it only that.

vLLM cuts a checkpoint for tensor parallelism as it loads it: column-parallel
layers (q, k, v, gate, up: fused into `qkv_proj` and `gate_up_proj`) keep a
block of output rows, row-parallel layers (o, down) a block of input columns,
the vocabulary-parallel embedding and head a block of vocabulary rows; a
key/value head is repeated on several ranks when there are fewer of them than
ranks. `tp_landing` works out, on each rank, the block of the full weight (a
box) that rank holds and the view of vLLM's storage it lands in; the engine
keeps only the boxes whose view holds exactly that block of the checkpoint
(`verified_slices`), and declares them in its weight spec as `RankBoxes`. A
weight vLLM transforms on load, or one outside these layers, stays declared
whole and goes through vLLM's own loader.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping

import torch

from gearshift import dist as gdist
from gearshift.mesh import MeshError, Placement
from gearshift.weights import WeightSpec

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RankBoxes(Placement):
    """The block of the full tensor each rank of the mesh holds, listed rank by rank (as the engine found it)."""

    boxes: tuple[Box, ...] = ()

    def local_box(self, shape: tuple[int, ...], rank: int) -> Box:
        if len(self.boxes) != self.mesh.world_size:
            raise MeshError(f"{len(self.boxes)} boxes for mesh {self.mesh} of {self.mesh.world_size} ranks")
        box = self.boxes[rank]
        if len(box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
            raise MeshError(f"box {box} does not fit a tensor of shape {tuple(shape)}")
        return box

    def is_replicated(self) -> bool:
        return len(set(self.boxes)) == 1  # every rank holds the same block: the whole weight, as listed

    def __str__(self) -> str:
        return "tp:" + "|".join(",".join(f"{lo}:{hi}" for lo, hi in b) for b in self.boxes[: self.mesh.tp])


def _rows(shape, start: int, stop: int) -> Box:
    return ((start, stop), *((0, n) for n in shape[1:]))


def _cols(shape, start: int, stop: int) -> Box:
    return ((0, shape[0]), (start, stop), *((0, n) for n in shape[2:]))


def tp_landing(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]], units: Mapping[str, str],
               packed: Mapping[str, list[str]]) -> dict[str, tuple[Box, torch.Tensor]]:
    """name -> (the box of the full weight this rank holds, the view of vLLM's storage it lands in), for the
    weights of tensor-parallel modules (`tp_size` > 1); `shapes` are the checkpoint's full shapes."""
    fused = {part: (whole, i) for whole, parts in packed.items() for i, part in enumerate(parts)}
    params = dict(model.named_parameters())
    out: dict[str, tuple[Box, torch.Tensor]] = {}
    for name, shape in shapes.items():
        unit, leaf = units.get(name), name.rpartition(".")[2]
        target = params.get(f"{unit}.{leaf}") if unit else None
        if target is None:
            continue
        module = model.get_submodule(unit)
        size, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
        if size == 1:
            continue
        kind = type(module).__name__
        part = name.rpartition(".")[0].rpartition(".")[2]
        if hasattr(module, "shard_indices"):  # vocabulary-parallel embedding or head: a block of rows, padded after
            lo, hi = module.shard_indices.org_vocab_start_index, module.shard_indices.org_vocab_end_index
            out[name] = (_rows(shape, lo, hi), target.data[: hi - lo])
        elif hasattr(module, "input_size_per_partition") and "Row" in kind:
            if leaf == "bias":  # added once, after the reduction: every rank holds it whole
                continue
            width = module.input_size_per_partition
            out[name] = (_cols(shape, rank * width, (rank + 1) * width), target.data)
        elif hasattr(module, "output_partition_sizes"):
            sizes = module.output_partition_sizes
            index = fused[part][1] if part in fused and unit.rpartition(".")[2] == fused[part][0] else 0
            if index >= len(sizes):
                continue
            start = sum(sizes[:index])
            # a key/value head repeated over several ranks: those ranks hold the same block
            shard = rank // getattr(module, "num_kv_head_replicas", 1) if kind.startswith("QKV") and index else rank
            rows = sizes[index]
            out[name] = (_rows(shape, shard * rows, (shard + 1) * rows), target.data[start:start + rows])
    return out


@torch.no_grad()
def verified_slices(landing: Mapping[str, tuple[Box, torch.Tensor]],
                    checkpoint: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[Box, torch.Tensor]]:
    """The entries of `landing` whose view holds exactly its box of the checkpoint's tensor.

    A block whose elements are all equal (a fresh bias or norm) matches whatever vLLM did to it; it
    counts only if every other weight of its module matched too (as `verified_landing` judges).
    """
    out, uniform, failed = {}, {}, set()
    for name, saved in checkpoint:
        if name not in landing:
            continue
        box, view = landing[name]
        want = saved[tuple(slice(lo, hi) for lo, hi in box)]
        if tuple(view.shape) != tuple(want.shape) or not torch.equal(view, want.to(view.device, view.dtype)):
            failed.add(name.rpartition(".")[0])
        elif want.numel() > 1 and bool((want == want.reshape(-1)[0]).all()):
            uniform[name] = (box, view)
        else:
            out[name] = (box, view)
    out.update({n: v for n, v in uniform.items() if n.rpartition(".")[0] not in failed})
    return {n: v for n, v in out.items() if n.rpartition(".")[0] not in failed}


def declare_slices(llm, spec: WeightSpec, units: Mapping[str, str], packed: Mapping[str, list[str]],
                   checkpoint: Iterable[tuple[str, torch.Tensor]]) -> tuple[WeightSpec, dict[str, torch.Tensor]]:
    """`spec` with each verified tensor-parallel weight declared as the blocks the ranks hold (`RankBoxes`),
    and the views those blocks land in on this rank. A collective: every rank of the engine calls it."""
    shapes = {p.name: tuple(p.shape) for p in spec}
    mine = verified_slices(llm.collective_rpc(_tp_landing, args=(shapes, dict(units), dict(packed)))[0], checkpoint)
    everyone = gdist.all_gather_object({n: box for n, (box, _) in mine.items()})
    common = set.intersection(*(set(boxes) for boxes in everyone))  # sliced only where every rank could land it
    params = tuple(replace(p, placement=RankBoxes(spec.mesh, boxes=tuple(e[p.name] for e in everyone)))
                   if p.name in common else p for p in spec)
    return replace(spec, params=params), {n: mine[n][1] for n in sorted(common)}


def _tp_landing(worker, shapes, units, packed):
    model = worker.model_runner.model
    return tp_landing(model, shapes, units, dict(getattr(model, "packed_modules_mapping", packed)))


__all__ = ["RankBoxes", "declare_slices", "tp_landing", "verified_slices"]
