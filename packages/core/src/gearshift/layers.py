"""The decoder layers of a Hugging Face causal LM, and compiling them one by one (`train.options.compile`).

A trainer shards the layers one by one (the fsdp backend) and may compile them one by one: each layer's
`forward` goes through `torch.compile` with dynamic shapes, so micro-batches of any rows and width reuse one
compiled graph, and every layer, running the same code, shares it. What the compiler fuses is the work between
the matrix products (normalisation, activations, rotary embeddings, residual additions), which otherwise reads
and writes the activations once per operation. The module and its parameters keep their names (a checkpoint, a
sync and an export see the same model); hooks around the layer (FSDP's gathering) stay outside the compiled
code. The first micro-batch of each new kind of shape pays the compile.
"""

from __future__ import annotations

import torch
from torch import nn

from . import dist as gdist


def decoder_layers(model: nn.Module, to: str | None = None) -> list[nn.Module]:
    """The repeated blocks of `model`: the classes the model (or one it wraps) lists in `_no_split_modules`, or
    where it lists none, the longest `nn.ModuleList` (the decoder stack, by convention). With `to` (what they are
    for: "shard", "compile"), finding none raises `ValueError` saying so."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    if not layers and to:
        raise ValueError(f"found no decoder layers to {to} in {type(model).__name__}: it lists no "
                         f"_no_split_modules and has no nn.ModuleList")
    return layers


#: graphs torch keeps for one compiled function before it gives up compiling it (torch's default is 8)
RECOMPILE_LIMIT = 64


#: model types whose compiled layers train like the uncompiled ones (gradients within 1e-4 of the largest, rows of
#: one length and padded), measured by tools/compile_matrix.py on the CPU (torch 2.13's inductor): 17 of the 19
#: tiny architectures. Falcon's gradients came out 2.7% off there and OPT's 150%; a model type not measured is
#: not compiled either
COMPILE_CHECKED = frozenset({
    "bloom", "cohere", "gemma", "gemma2", "gemma3_text", "gpt2", "gptj", "granite", "llama", "mistral", "mixtral",
    "phi", "phi3", "qwen2", "qwen3", "qwen3_moe", "stablelm",
})


def model_type(model: nn.Module) -> str | None:
    """The Hugging Face `model_type` of `model` or of the model it wraps (a value head's)."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "model_type", None):
            return config.model_type
    return None


def compile_layers(model: nn.Module, checked: bool = True) -> int:
    """Compile the `forward` of each of `model`'s decoder layers in place (dynamic shapes); returns how many.
    Raises `ValueError` for a model with no decoder layers to find, or (`checked`) whose model type is not one
    of `COMPILE_CHECKED`."""
    layers = decoder_layers(model, to="compile")
    kind = model_type(model)
    if checked and kind not in COMPILE_CHECKED:
        raise ValueError(f"train.options.compile: compiled layers of model type {kind!r} are not checked against "
                         f"uncompiled ones (tools/compile_matrix.py); checked: {', '.join(sorted(COMPILE_CHECKED))}")
    import torch._dynamo

    # each kind of call is a graph of its own (with and without grad, a padding mask or none, one row or
    # several), and every compiled layer of the process shares the layer class's count: past the limit,
    # torch runs the layer uncompiled
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        if not getattr(layer.forward, "_gearshift_compiled", False):
            layer.forward = torch.compile(layer.forward, dynamic=True)
            layer.forward._gearshift_compiled = True
    if gdist.rank() == 0:
        print(f"gearshift: {len(layers)} decoder layers ({type(layers[0]).__name__}) compile on their first call: "
              f"the first train step and the first forward without gradients take longer", flush=True)
    return len(layers)


__all__ = ["COMPILE_CHECKED", "RECOMPILE_LIMIT", "compile_layers", "decoder_layers", "model_type"]
