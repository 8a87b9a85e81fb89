"""Where a trainer's weight lands in a rollout engine's own parameters, for writing it there directly.

For engines in vLLM's lineage (vLLM, SGLang): their models keep q, k and v in
one fused `qkv_proj` parameter and gate and up in one `gate_up_proj`, pad the
vocabulary to a multiple of some size, and may tie the head to the embedding,
so a Hugging Face weight is a block of rows of one of their parameters. Their
`load_weights` finds that block for every tensor in Python on every update.

A backend works it out once, at engine start, while the engine still holds the
model folder's checkpoint: `load_units` (the module each weight loads into),
`landing_views` (the rows of that module's parameter), then `verified_landing`
keeps only the views that hold exactly what the checkpoint holds
(`checkpoint_tensors`). A sync then copies each new weight into its view,
casting in the copy (`gearshift.weights.copy_weights_`). A weight the engine
transforms on load (re-ordered, quantized, repacked) fails the check and goes
through the engine's own loader, so a wrong guess here costs speed, never
correctness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from .stored import stored_layout
from .weights import WeightSpec

#: the fused parameters of Llama-style models, for a model that does not say (SGLang's keep theirs in a list
#: inside `load_weights`); vLLM's models carry it as `packed_modules_mapping`
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


#: transformers' stacked experts of a mixture-of-experts layer -> the parameter of the same layout (experts x
#: rows x columns, gate rows before up rows) that vLLM's and SGLang's fused MoE layers hold, at any depth below
#: the layer's module (vLLM 0.32 keeps it in a `routed_experts` child)
EXPERTS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


def fused_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model's `packed_modules_mapping` ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), else `FUSED`."""
    return dict(getattr(model, "packed_modules_mapping", None) or FUSED)


def load_units(names: Iterable[str], modules: set[str], packed: Mapping[str, list[str]]) -> dict[str, str]:
    """name -> the engine's module its weight loads into (the unit that must arrive whole).

    `packed` is the model's fused-module mapping (`fused_modules`); a name whose module the engine
    does not have maps to its nearest ancestor that it has.
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


def landing_views(model: torch.nn.Module, names: Iterable[str], units: Mapping[str, str],
                  packed: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """name -> the slice of the engine's parameter storage that weight `name` is loaded into.

    A weight that the engine fuses (q, k and v into `qkv_proj`; gate and up into `gate_up_proj`)
    lands in rows of the fused parameter, at the offsets its module's
    `output_partition_sizes` give; a padded vocabulary keeps the checkpoint's rows first. A
    mixture-of-experts layer's stacked experts land in the engine's own stack (`EXPERTS`).
    Only unsharded modules (tensor parallel size 1) are mapped: a weight left out is loaded
    through the engine's `load_weights`. A module wrapped to serve LoRA adapters (vLLM's) keeps
    the weight in its `base_layer`. `verified_landing` then keeps only the views that hold
    exactly what the checkpoint holds, so a weight the engine transforms on load is never
    written around its loader.
    """
    fused = {part: (whole, i) for whole, parts in packed.items() for i, part in enumerate(parts)}
    params = dict(model.named_parameters())
    views: dict[str, torch.Tensor] = {}
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        unit = owner = units.get(name)
        if unit and f"{unit}.base_layer.{leaf}" in params:  # a LoRA wrapper: the weight is its base layer's
            owner = f"{unit}.base_layer"
        target = params.get(f"{owner}.{leaf}") if owner else None
        if target is None and owner and leaf in EXPERTS:  # transformers' stacked experts: the engine's own stack
            target = next((params[n] for n in params if n.startswith(f"{owner}.") and
                           n.rpartition(".")[2] == EXPERTS[leaf]), None)
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
    """The views that hold exactly the checkpoint's tensor (cut to its rows where the engine pads them).

    A tensor whose elements are all equal (a freshly initialised bias or norm) matches a view
    whatever order the engine put its elements in; it counts only if no tensor of its module failed
    the check (BLOOM's fused query_key_value, which vLLM re-orders on load: its weight fails, and its
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
    """(name, tensor) of the folder's safetensors files for the weights of `spec`, one file open at a time, in
    the form transformers holds them (experts stored one by one come stacked: `gearshift.stored`)."""
    layout = stored_layout(str(model_path))
    names = set(spec.names()) | set(spec.aliases)
    for name, tensor in layout.from_stored(_stored_tensors(model_path, names | layout.stored_names())):
        if name in names:
            yield spec.canonical(name), tensor


def _stored_tensors(model_path: str, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in wanted:
                    yield key, st.get_tensor(key)


__all__ = ["EXPERTS", "FUSED", "checkpoint_tensors", "fused_modules", "landing_views", "load_units", "verified_landing"]
