"""Tensor parallelism of a Hugging Face causal LM: the model's own plan, applied with DTensor's styles.

transformers ships a tensor-parallel plan for most architectures (`model.tp_plan`:
the config's `base_model_tp_plan` under the base model's prefix, plus the class's
`_tp_plan` for the output head): module paths with `*` for a layer index, each
with a style name. `parallelize_tensor` applies it on a 1-D `tp` device mesh with
PyTorch's own styles (`ColwiseParallel`, `RowwiseParallel`), the Megatron layout:
q, k, v, gate and up cut by output rows (each rank computes a slice of the heads
and of the MLP), o and down cut by input columns, whose partial sums are
all-reduced, so between blocks every rank holds the whole hidden state. Weights
outside the plan (embeddings, norms, a head tied to the embeddings) stay whole.

Works with LoRA (peft's layers): the base layer takes the style; of the adapter,
B follows a column-parallel layer (A stays whole) and A a row-parallel one (B
stays whole), so `W x + B A x` is cut exactly as `W x` is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .mesh import MeshError, MeshSpec, Placement

#: the plan's style names this module applies, by what each does to a linear layer
COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")
ROWWISE = ("rowwise", "rowwise_split_input")
#: weights left whole whose gradients, computed from a slice of the heads, are partial sums over tp
GRAD_ALLREDUCE = ("replicated_with_grad_allreduce",)
EMBEDDING = ("embedding_rowwise",)
SUPPORTED = COLWISE + ROWWISE + GRAD_ALLREDUCE + EMBEDDING


class TensorParallelError(MeshError):
    """A model whose tensor-parallel plan cannot be applied at the asked size."""


@dataclass(frozen=True)
class Applied:
    """What `parallelize_tensor` did: module path -> style, and the parameters whose gradients need a tp all-reduce."""

    styles: dict[str, str]
    partial_grads: tuple[str, ...]


def model_tp_plan(hf_model: nn.Module) -> dict[str, str]:
    """The model's own plan, {module path pattern: style}, with paths from the causal LM's root."""
    plan = dict(getattr(hf_model, "tp_plan", None) or {})
    if not plan:
        base = dict(getattr(hf_model.config, "base_model_tp_plan", None) or {})
        prefix = getattr(hf_model, "base_model_prefix", "model")
        plan = {f"{prefix}.{k}": v for k, v in base.items()}
        plan.update(getattr(type(hf_model), "_tp_plan", None) or {})
    return plan


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + "$")


def resolve_plan(module: nn.Module, hf_model: nn.Module) -> dict[str, str]:
    """{module path in `module`: style}: the model's plan matched against `module`, which holds `hf_model`
    (itself, or under a value head); a head tied to the embeddings, and the embeddings then, stay whole."""
    plan = model_tp_plan(hf_model)
    if not plan:
        raise TensorParallelError(
            f"{type(hf_model).__name__} ships no tensor-parallel plan (config.base_model_tp_plan): train it with "
            f"tp=1 (shard over dp), or pick a model whose transformers class has one (Qwen2, Llama, Mistral, ...)")
    unknown = sorted({s for s in plan.values() if s not in SUPPORTED})
    if unknown:
        raise TensorParallelError(f"{type(hf_model).__name__}'s tensor-parallel plan uses styles {unknown}, which "
                                  f"gearshift does not apply (it applies {list(SUPPORTED)}): use tp=1")
    prefix = next(n for n, m in module.named_modules() if m is hf_model)
    prefix = f"{prefix}." if prefix else ""
    out_head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    in_emb = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
    tied = out_head is not None and in_emb is not None and out_head.weight is in_emb.weight
    patterns = [(_pattern(prefix + key), style) for key, style in plan.items()]
    resolved: dict[str, str] = {}
    for name, sub in module.named_modules():
        style = next((s for p, s in patterns if p.match(name)), None)
        if style is None:
            continue
        if tied and (sub is out_head or sub is in_emb):
            continue  # one tensor serves both: cutting it for one would cut it wrongly for the other
        resolved[name] = style
    return resolved


def check_divisible(hf_model: nn.Module, tp: int, what: str = "tp") -> None:
    """Raise a `TensorParallelError` unless `tp` divides the attention heads (query and key/value)."""
    config = hf_model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise TensorParallelError(
                f"{what}={tp} must divide the model's {key}={heads} (each rank computes whole heads): use a "
                f"{what} that divides {heads}, or {what}=1")


def _styles(style: str, target: nn.Module):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate())
    if style in ("rowwise", "embedding_rowwise"):
        return RowwiseParallel()
    raise TensorParallelError(f"no style {style!r} for {type(target).__name__}")


def _lora_parts(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(base layer, A, B) of a peft LoRA layer, else None."""
    base = getattr(layer, "base_layer", None)
    lora_a, lora_b = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    if base is None or lora_a is None or lora_b is None:
        return None
    return base, lora_a["default"], lora_b["default"]


def parallelize_tensor(module: nn.Module, hf_model: nn.Module, tp_mesh) -> Applied:
    """Cut `module` (holding `hf_model`) for tensor parallelism over the 1-D `tp_mesh`, in place.

    Every rank holds the same weights beforehand (they loaded the same folder), so each keeps its
    own slice without any communication.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_divisible(hf_model, tp)
    resolved = resolve_plan(module, hf_model)
    plan, partial = {}, []
    for path, style in resolved.items():
        layer = module.get_submodule(path)
        if style in GRAD_ALLREDUCE:
            partial.extend(f"{path}.{n}" for n, _ in layer.named_parameters())
            continue
        parts = _lora_parts(layer)
        base = parts[0] if parts else layer
        dim = 0 if style in COLWISE + EMBEDDING else 1  # an embedding is cut by vocabulary rows
        weight = base.weight
        if weight.shape[dim] % tp:
            raise TensorParallelError(f"tp={tp} must divide dim {dim} of {path}.weight {tuple(weight.shape)}: "
                                      f"use a tp that divides {weight.shape[dim]}, or tp=1")
        plan[f"{path}.base_layer" if parts else path] = _styles(style, base)
        if parts:  # the adapter cut so that B A x is split as W x is
            _, lora_a, lora_b = parts
            if style in COLWISE:
                plan[f"{path}.lora_B.default"] = _styles("colwise", lora_b)
            else:
                plan[f"{path}.lora_A.default"] = _styles("rowwise", lora_a)
    parallelize_module(module, tp_mesh, plan, src_data_rank=None)
    return Applied(resolved, tuple(partial))


def tp_placement(param: torch.Tensor, mesh: MeshSpec) -> Placement:
    """The placement of a parameter of a tensor-parallel module on `mesh` (whole elsewhere)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return Placement.replicated(mesh)
    shards = [p.dim for p in placements if p.is_shard()]
    return Placement.of(mesh, {"tp": shards[0]}) if shards else Placement.replicated(mesh)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (itself for a plain tensor); shares its storage."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


__all__ = ["Applied", "TensorParallelError", "check_divisible", "local_tensor", "model_tp_plan",
           "parallelize_tensor", "resolve_plan", "tp_placement"]
