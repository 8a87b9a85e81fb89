"""LoRA adapters (through peft) on a trainer's module, and the merged weights every rollout engine takes.

`add_lora` puts peft's LoRA layers into a Hugging Face causal LM and freezes
everything else, so only the adapters train and only they get optimizer state.
A rollout engine never learns of it: `LoraWeights` lists the base model's
weights under their Hugging Face names (peft's `.base_layer` and adapter
parameters left out), and reading a weight that carries an adapter gives the
merged tensor `W + scale * B @ A`, in W's shape, dtype and placement. The
planner, the stream and every rollout engine work on that unchanged.

Sharded trainers (FSDP) shard the adapter matrices too. The slice of
`B @ A` that matches this rank's slice of W needs rows of B and columns of A
that other ranks may hold, so `gathered(names)` (entered around each bucket
of an export, on every rank) gathers the factors of that bucket's weights:
r x (in + out) numbers per weight, small beside W.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from .weights import Adapter

ADAPTER = "default"  # peft's name for the one adapter a trainer holds
INSTALL = "pip install 'gearshift[lora]' (peft)"


def import_peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError(f"LoRA needs peft, which is not importable ({err}): {INSTALL}") from err
    return peft


def add_lora(model: nn.Module, *, r: int, alpha: int, dropout: float = 0.0,
             target_modules: Sequence[str] = ("all-linear",)) -> nn.Module:
    """Put LoRA layers of rank `r` (scale alpha / r) into `model`'s `target_modules`, in place; freeze the rest.

    `target_modules` are module names or suffixes (`q_proj`, `v_proj`), or `all-linear`: every
    linear layer but the output head. B starts at zero, so the model computes what it did before.
    """
    peft = import_peft()
    if r < 1:
        raise ValueError(f"LoRA rank r={r} must be >= 1")
    targets = list(target_modules)
    if not targets:
        raise ValueError("LoRA target_modules is empty: name the layers to adapt, or use 'all-linear'")
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else targets)
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's message names the modules it did not find
        raise ValueError(f"LoRA target_modules={targets}: {err}") from None
    return model


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: peft's wrapper level (`.base_layer`) taken out."""
    return name.replace(".base_layer.", ".")


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor is gathered: every rank must call this)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _row_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor chunked on dim 0 over a 1-D mesh (FSDP's layout)."""
    placements = getattr(tensor, "placements", None)
    return placements is not None and tensor.device_mesh.ndim == 1 and len(placements) == 1 \
        and placements[0].is_shard(0)


def gather_whole(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor whole on every rank (a collective when sharded), with one message for all of FSDP's
    row-sharded ones instead of one per tensor: a bucket's adapters are many small tensors."""
    import torch.distributed as dist

    out: list[torch.Tensor | None] = [None] * len(tensors)
    sharded = [i for i, t in enumerate(tensors) if _row_sharded(t)]
    for i, t in enumerate(tensors):
        if i not in sharded:
            out[i] = _full(t)
    if not sharded:
        return out
    mesh = tensors[sharded[0]].device_mesh
    if any(tensors[i].device_mesh != mesh for i in sharded):  # one group per message: go tensor by tensor
        return [o if o is not None else _full(t) for o, t in zip(out, tensors)]
    world = mesh.size()
    # every rank's slice padded to the chunk torch.chunk gives rank 0, so all messages have one size
    chunks = [-(-tensors[i].shape[0] // world) for i in sharded]
    rows = [math.prod(tensors[i].shape[1:]) for i in sharded]
    local = [tensors[i].to_local() for i in sharded]
    flat = local[0].new_zeros(sum(c * r for c, r in zip(chunks, rows)))
    at = 0
    for piece, c, r in zip(local, chunks, rows):
        flat[at:at + piece.numel()].copy_(piece.reshape(-1))
        at += c * r
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat, group=mesh.get_group())
    at = 0
    for i, c, r in zip(sharded, chunks, rows):
        n = tensors[i].shape[0]
        held = [max(0, min(c, n - k * c)) for k in range(world)]  # rows each rank holds, as torch.chunk cuts
        whole = torch.cat([parts[k][at:at + held[k] * r] for k in range(world)])
        out[i] = whole.view(tensors[i].shape)
        at += c * r
    return out


@dataclass
class _Adapter:
    """One adapted linear layer: its peft layer and where its module lies in the Hugging Face model."""

    layer: nn.Module
    module_name: str  # e.g. 'model.layers.0.self_attn.q_proj'
    scale: float
    transposed: bool  # peft's fan_in_fan_out: W is stored [in, out] (GPT-2's Conv1D)

    @property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.lora_A[ADAPTER].weight, self.layer.lora_B[ADAPTER].weight


class LoraWeights:
    """The base weights of a module with LoRA layers under Hugging Face names, merged with their adapters on read.

    Built from the module after `add_lora` and before it is sharded; `bind()` looks the
    parameters up again once the module is sharded (FSDP puts new ones in place).
    `hf_prefix` is where the causal LM sits in the module ('lm.' under a value head): adapter
    files name modules relative to the causal LM.
    """

    def __init__(self, module: nn.Module, hf_prefix: str = "") -> None:
        lora = import_peft().tuners.lora
        self.hf_prefix = hf_prefix
        self._where: dict[str, tuple[nn.Module, str]] = {}  # Hugging Face name -> (owning module, attribute)
        self._adapters: dict[str, _Adapter] = {}  # Hugging Face name of an adapted weight -> its adapter
        owners: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(name)
        for name, _ in module.named_parameters():  # a tied weight once, under its first name
            if not _is_adapter(name):
                owner_name, _, attr = name.rpartition(".")
                self._where[hf_name(name)] = (module.get_submodule(owner_name) if owner_name else module, attr)
        for layer_name, layer in module.named_modules():
            if not isinstance(layer, lora.LoraLayer):
                continue
            if not isinstance(layer, lora.Linear):
                raise ValueError(f"LoRA on {layer_name} ({type(layer.get_base_layer()).__name__}): only linear "
                                 f"layers can be merged for the rollout engine; leave it out of target_modules")
            names = owners[id(layer.base_layer.weight)]
            if len(names) > 1:
                raise ValueError(f"LoRA on {layer_name}, whose weight is tied to "
                                 f"{[hf_name(n) for n in names if not n.startswith(layer_name + '.')]}: one tensor "
                                 f"cannot carry the adapter in one place and not the other; leave it out of "
                                 f"target_modules")
            self._adapters[hf_name(names[0])] = _Adapter(layer, layer_name.removeprefix(hf_prefix),
                                                         float(layer.scaling[ADAPTER]), bool(layer.fan_in_fan_out))
        self._params: dict[str, torch.Tensor] = {}
        self._factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bind()

    def bind(self) -> None:
        """Look every parameter up in its module again (call once the module is sharded)."""
        self._params = {n: owner._parameters[attr] for n, (owner, attr) in self._where.items()}
        self._factors = {n: a.factors for n, a in self._adapters.items()}

    # --- what the weight spec lists ------------------------------------------------------------
    def base_parameters(self) -> dict[str, torch.Tensor]:
        """Every weight the rollout engine takes, under its Hugging Face name (merged ones at their base)."""
        return dict(self._params)

    def adapted(self) -> list[str]:
        """The names of the weights that carry an adapter."""
        return list(self._adapters)

    def parameters_read(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The parameters an export of `names` reads: their bases and the adapters' factors."""
        out = [self._params[n] for n in names]
        for n in names:
            if n in self._factors:
                out.extend(self._factors[n])
        return out

    # --- merged reads --------------------------------------------------------------------------
    @contextmanager
    def gathered(self, names: Sequence[str]) -> Iterator[None]:
        """The factors of `names`' adapters whole on every rank until the context closes (a collective)."""
        adapted = [n for n in names if n in self._factors]
        with torch.no_grad():
            whole = gather_whole([f.detach() for n in adapted for f in self._factors[n]])
        self._gathered = {n: (whole[2 * i], whole[2 * i + 1]) for i, n in enumerate(adapted)}
        try:
            yield
        finally:
            self._gathered = {}

    @torch.no_grad()
    def merged(self, name: str, local_base: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """`name`'s slice `box` (this rank's, of the full shape) with its adapter merged in; the base itself
        (`local_base`, this rank's slice of W) when it carries none."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return local_base
        if name in self._gathered:
            a, b = self._gathered[name]
        else:
            a, b = (f.detach() for f in self._factors[name])
            if hasattr(a, "full_tensor"):
                raise RuntimeError(f"the adapter of {name!r} is sharded: read merged weights inside "
                                   f"gathered(names) (the train engine's `materialized`)")
        (r0, r1), (c0, c1) = box
        if adapter.transposed:  # W is [in, out]: its slice is the transpose of (B @ A)'s
            left, right = a[:, r0:r1].T, b[c0:c1].T
        else:
            left, right = b[r0:r1], a[:, c0:c1]
        dtype = local_base.dtype
        # one fused op: W + scale * (left @ right), in the adapter's dtype when that is wider
        wide = torch.promote_types(dtype, left.dtype)
        merged = torch.addmm(local_base.to(wide), left.to(local_base.device, wide), right.to(local_base.device, wide),
                             alpha=adapter.scale)
        return merged.to(dtype)

    # --- the adapter alone ---------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapters' factors, whole, under the names peft's files use (a collective when sharded)."""
        names = list(self._adapters)
        with torch.no_grad():
            whole = gather_whole([f.detach() for n in names for f in self._factors[n]])
        out = {}
        for i, name in enumerate(names):
            key = f"base_model.model.{self._adapters[name].module_name}"
            out[f"{key}.lora_A.weight"] = whole[2 * i].cpu().contiguous()
            out[f"{key}.lora_B.weight"] = whole[2 * i + 1].cpu().contiguous()
        return out

    def adapter_bytes(self) -> int:
        """Bytes of every adapter factor, whole (what an adapter-only sync would move)."""
        return sum(_numel(f) * f.element_size() for pair in self._factors.values() for f in pair)

    def peft_config(self, hf_model: nn.Module, base_model: str):
        """The `peft.LoraConfig` of the adapters, naming `base_model` as the model they apply to."""
        import copy

        config = copy.deepcopy(hf_model.peft_config[ADAPTER])
        config.base_model_name_or_path = base_model
        config.inference_mode = True
        return config

    def adapter(self, hf_model: nn.Module, base_model: str) -> Adapter:
        """The adapter whole, with its peft config as adapter_config.json holds it (a collective when sharded)."""
        config = self.peft_config(hf_model, base_model).to_dict()
        for key, value in config.items():  # as peft writes it: sets as (sorted) lists
            if isinstance(value, set):
                config[key] = sorted(value)
        return Adapter(self.adapter_state(), config)


def _numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape:  # a DTensor's shape is the whole tensor's
        n *= d
    return n


__all__ = ["LoraWeights", "add_lora", "gather_whole", "hf_name", "import_peft"]
