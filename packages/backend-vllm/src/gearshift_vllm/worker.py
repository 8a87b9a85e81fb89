"""Code run inside vLLM's worker, through `LLM.collective_rpc(fn, args)`.

The worker lives in this process (the engine is in-process), so these functions
see its model directly; each takes the worker first and returns plain data, or
views of the model's own storage.
"""

from __future__ import annotations

import torch

from gearshift.landing import landing_views
from gearshift.memory import tensor_bytes

from .cpu_loader import packed_modules


def model_layout(worker) -> dict:
    """The module names, fused-module mapping and tied weights of the worker's model."""
    model = worker.model_runner.model
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    tied: dict[str, list[str]] = {}
    for names in owners.values():
        for extra in names[1:]:  # the first owner loads the weight; the others only share it
            if hasattr(model.get_submodule(extra), "quant_method"):
                tied.setdefault(f"{names[0]}.weight", []).append(extra)
    return {"modules": {n for n, _ in model.named_modules()},
            "packed": dict(getattr(model, "packed_modules_mapping", {})), "tied": tied,
            "packed_copies": packed_modules(model)}


def model_landing_views(worker, units: dict[str, str], packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Where each weight lands in the worker's parameters (`gearshift.landing.landing_views`)."""
    model = worker.model_runner.model
    return landing_views(model, units, units, dict(getattr(model, "packed_modules_mapping", packed)))


def repack_modules(worker, names: list[str]) -> None:
    """Rebuild the CPU packed copy of modules whose shared weight was reloaded (a tied lm_head)."""
    model = worker.model_runner.model
    for name in names:
        module = model.get_submodule(name)
        module.quant_method.process_weights_after_loading(module)


def held_bytes(worker) -> dict[str, int]:
    """Bytes the worker holds in the model's parameters and in the KV cache."""
    runner = worker.model_runner
    weights = tensor_bytes(list(runner.model.parameters()))
    kv = tensor_bytes(getattr(runner, "kv_caches", []))
    return {"weights": weights, "kv_cache": kv}

